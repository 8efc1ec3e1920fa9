"""Lockstep and the bounded walk check the KV event stream after every step: each planted
producer bug (``tests.support.planted_stream_bugs``) is caught by the stream check, named
in the failure, before the event-for-event comparison with the spec."""

import pytest
from hypothesis.stateful import run_state_machine_as_test

from impl import KVCacheManager
from tests.allocator.test_allocator_state_machine import CATCHING
from tests.support.bounded import Bounds, check
from tests.support.host_lockstep import HostTierMachine
from tests.support.lockstep import machine_for
from tests.support.planted_stream_bugs import (
    ForgetsTheClearOnReset,
    PublishesNoHostKeys,
    RemovesWhileACopyRemains,
    SkipsASequenceNumber,
    StoresBeforeTheWrite,
    StoresChildrenFirst,
)

MESSAGES: dict[type[KVCacheManager], str] = {
    StoresBeforeTheWrite: "the set model holds 1 key(s) the spec's caches do not",
    RemovesWhileACopyRemains: "the set model holds 0 key(s) the spec's caches do not (-) and lacks",
    ForgetsTheClearOnReset: "reset the prefix cache but published no AllBlocksCleared",
}


@pytest.mark.parametrize("broken", list(MESSAGES), ids=lambda cls: cls.__name__)
def test_lockstep_s_stream_check_catches_each_planted_producer_bug(
    broken: type[KVCacheManager],
) -> None:
    with pytest.raises(AssertionError, match=r"KV event stream: .*: impl\b") as caught:
        run_state_machine_as_test(machine_for(broken), settings=CATCHING)
    assert MESSAGES[broken] in str(caught.value)


def test_lockstep_s_stream_check_catches_a_skipped_sequence_number() -> None:
    machine = machine_for(KVCacheManager, publisher_class=SkipsASequenceNumber)
    with pytest.raises(
        AssertionError, match=r"KV event stream: .*: impl: batch 3 follows batch 1\n"
    ):
        run_state_machine_as_test(machine, settings=CATCHING)


# The smallest pool shape and shortest path that shows each bug, breadth first.
SHORTEST: dict[type[KVCacheManager], tuple[Bounds, list[str]]] = {
    StoresBeforeTheWrite: (
        Bounds(1, 2, ("r0",), 2, prompts=((0,),)),
        ["allocate('r0', (0,))", "truncate('r0', 0)", "append('r0', (0,))"],
    ),
    RemovesWhileACopyRemains: (
        Bounds(1, 1, ("r0", "r1"), 1, prompts=((0,),)),
        ["allocate('r0', (0,))", "fork('r0', 'r1')", "release('r0')"],
    ),
    ForgetsTheClearOnReset: (Bounds(1, 1, ("r0",), 1, prompts=((0,),)), ["reset_prefix_cache()"]),
}


@pytest.mark.parametrize("broken", list(SHORTEST), ids=lambda cls: cls.__name__)
def test_the_bounded_walk_s_stream_check_catches_each_planted_producer_bug(
    broken: type[KVCacheManager],
) -> None:
    bounds, path = SHORTEST[broken]
    violation = check(bounds, broken).violation
    assert violation is not None, f"{broken.__name__} passed the bounded walk"
    assert violation.reason.startswith("impl's stream")
    assert MESSAGES[broken] in violation.reason
    assert [str(op) for op in violation.path] == path


def test_the_host_machine_s_stream_check_catches_a_host_cache_that_publishes_nothing() -> None:
    with pytest.raises(AssertionError, match=r"KV event stream: .*: impl: .* and lacks") as caught:
        run_state_machine_as_test(
            machine_for(PublishesNoHostKeys, HostTierMachine), settings=CATCHING
        )
    assert "CPU)" in str(caught.value)


def test_the_host_machine_s_stream_check_catches_a_child_stored_before_its_parent() -> None:
    machine = machine_for(KVCacheManager, HostTierMachine, publisher_class=StoresChildrenFirst)
    with pytest.raises(AssertionError, match=r": impl: a store of .* before its parent"):
        run_state_machine_as_test(machine, settings=CATCHING)
