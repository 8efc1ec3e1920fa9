"""The host tier's invariants, each broken by a hand-built state (and kept by a sound one)."""

from dataclasses import replace

import pytest

import spec
from spec import AllocatorState, FrozenMap, SwappedRequest, violated_invariants
from spec.api import OPERATIONS
from spec.invariants import is_usage_consistent


def _swapped_with_copies_pending() -> AllocatorState:
    """Blocks 0 and 1 of "a" copied out to host blocks 0 and 1, in flight; "b" holds 2."""
    state = spec.init(4, 2, host_blocks=3)
    state, _ = OPERATIONS["allocate"].transition(state, "a", 3)
    state, _ = OPERATIONS["allocate"].transition(state, "b", 1)
    state, _ = OPERATIONS["swap_out"].transition(state, "a")
    return state


def test_a_swapped_state_with_copies_pending_breaks_no_invariant() -> None:
    state = _swapped_with_copies_pending()
    assert state.host.in_flight_block_ids == (1, 0)
    assert violated_invariants(state) == []


def test_a_lost_host_block_breaks_host_partition() -> None:
    state = _swapped_with_copies_pending()
    host = replace(state.host, free_host_block_ids=())  # host block 2 is nowhere
    assert violated_invariants(replace(state, host=host)) == ["host_partition"]


def test_a_swapped_request_that_still_holds_a_table_breaks_swapped_sound() -> None:
    state = _swapped_with_copies_pending()
    record = SwappedRequest(((2,),), 1, (0,))
    host = replace(state.host, swapped=state.host.swapped.set("b", record))
    broken = violated_invariants(replace(state, host=host))
    assert "swapped_sound" in broken


def test_a_block_in_a_free_queue_while_its_copy_out_is_pending_breaks_the_pending_copy_rule() -> (
    None
):
    state = _swapped_with_copies_pending()
    # Blocks 1 and 0 land in the free queue before take_swap_copies: vLLM #47653.
    landed = replace(
        state,
        free_block_ids=(*state.free_block_ids, 1, 0),
        host=replace(state.host, in_flight_block_ids=()),
    )
    assert violated_invariants(landed) == ["copy_source_in_flight"]


def test_a_missing_in_flight_block_breaks_conservation_and_the_pending_copy_rule() -> None:
    state = _swapped_with_copies_pending()
    lost = replace(state, host=replace(state.host, in_flight_block_ids=(1,)))
    assert violated_invariants(lost) == ["conservation", "partition", "copy_source_in_flight"]


def test_a_host_cached_block_without_a_key_breaks_host_partition() -> None:
    state = spec.init(2, 1, host_blocks=2, host_prefix_cache=True)
    host = replace(
        state.host,
        free_host_block_ids=(1,),
        host_cached_block_ids=(0,),
        host_caches=(FrozenMap(),),
    )
    assert violated_invariants(replace(state, host=host)) == ["host_partition"]


@pytest.mark.parametrize(
    "record",
    [
        SwappedRequest(((0, 1), ()), 3, (0, 0)),  # two groups in a pool of one
        SwappedRequest(((0, 1),), 3, (0, 0)),  # skipped blocks of two groups
        SwappedRequest(((0, 1),), 5, (0,)),  # 5 tokens take 3 blocks, not 2
        SwappedRequest(((0, 1),), 3, (1,)),  # 1 skipped + 2 held is 3 blocks, not 2
        SwappedRequest(((0, 1),), 3, (0,), token_ids=(1, 2)),  # 2 token ids for 3 tokens
        SwappedRequest(((0, 1),), 3, (0,), cache_salt="s"),  # a salt without token ids
    ],
    ids=["group-count", "skipped-count", "token-count", "skipped", "token-ids", "salt-without-ids"],
)
def test_a_swapped_record_that_does_not_add_up_breaks_swapped_sound(
    record: SwappedRequest,
) -> None:
    state = _swapped_with_copies_pending()
    host = replace(state.host, swapped=state.host.swapped.set("a", record))
    assert violated_invariants(replace(state, host=host)) == ["swapped_sound"]


def _step(state: AllocatorState, operation: str, *args: object) -> AllocatorState:
    after, _ = OPERATIONS[operation].transition(state, *args)
    return after


def test_sound_states_with_each_kind_of_pending_copy_break_no_invariant() -> None:
    # A copy-on-write: "b" forks "a" and appends into their shared last block.
    state = _step(_step(spec.init(4, 2), "allocate", "a", 3), "fork", "a", "b")
    copy_on_write = _step(state, "append", "b", 1)
    assert copy_on_write.pending_copies == ((1, 2),)
    # Copies back in: "a" swapped in before its copies out were taken.
    state = _step(_swapped_with_copies_pending(), "release", "b")
    swapped_in = _step(state, "swap_in", "a")
    assert swapped_in.host.pending_host_to_device == ((0, 3), (1, 2))
    # A write-through copy out of a freed cached block, to the host cache.
    state = spec.init(4, 2, host_blocks=2, host_prefix_cache=True)
    demoted = _step(_step(state, "allocate", "a", (1, 2, 3)), "release", "a")
    assert demoted.host.pending_device_to_host == ((0, 0),)
    for sound in (copy_on_write, swapped_in, demoted):
        assert violated_invariants(sound) == []


def test_a_copy_into_a_block_no_table_holds_breaks_copy_destination_held() -> None:
    state = _step(_step(spec.init(4, 2), "allocate", "a", 3), "fork", "a", "b")
    state = _step(state, "append", "b", 1)
    stray = replace(state, pending_copies=((1, 3),))  # block 3 is free
    assert "copy_destination_held" in violated_invariants(stray)


def test_a_block_in_flight_and_in_the_free_queue_breaks_the_pending_copy_rule() -> None:
    state = _swapped_with_copies_pending()
    both = replace(state, free_block_ids=(*state.free_block_ids, 1))
    assert "copy_source_in_flight" in violated_invariants(both)


def test_blocks_in_flight_count_as_used_in_a_consistent_usage_report() -> None:
    state = _swapped_with_copies_pending()
    report = spec.usage(state)
    assert (report.used_blocks, len(state.host.in_flight_block_ids)) == (3, 2)
    assert is_usage_consistent(state, report)
