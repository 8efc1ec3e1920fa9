"""The kit reads vLLM's KV cache events through the engine adapter: the ``KVEventBatch``es
its real ``Scheduler`` publishes at the end of each step (``update_from_output``, from its
``KVCacheManager.take_events()``), handed over by the adapter's ``take_events()`` and judged
after every step against the spec's stream (``harness.conformance.events``). Bugs planted
in vLLM's own emission are in the zoo (``tests.conformance.zoo``, caught by ``events_*``);
the finding (a hash removed while a copy stays cached) is pinned in test_findings.py."""

import importlib.util
from typing import Any

import pytest

from harness.conformance.adapter import KV_EVENTS
from harness.conformance.events import TargetStored
from harness.conformance.judge import Tally
from harness.conformance.machine import EngineMachine, machine_for
from harness.conformance.targets import CONFIGURATIONS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs the 'conformance' pins)",
)

P9 = (1, 2, 3, 1, 2, 3, 1, 2, 0)


def test_the_engine_adapter_hands_over_each_published_batch_once() -> None:
    engine: Any = CONFIGURATIONS["vllm-full"]()  # Any: the VLLMEngine (vLLM is optional)
    engine.submit("r0", P9, "a")
    engine.step({"r0": 0}, frozenset())
    events = engine.take_events()
    # The prefill's two full blocks, one store of a chain, the salt on its first block.
    assert events == [TargetStored(events[0].block_hashes, None, P9[:8], "a", 0, "GPU")]
    assert len(events[0].block_hashes) == 2
    assert engine.take_events() == []


def test_every_step_s_events_are_judged() -> None:
    """The same prompt admitted twice: its second block is computed and cached again, and
    stored again while present: the declared ``events_stored_twice``, counted."""
    tally = Tally()
    kit = machine_for(CONFIGURATIONS["vllm-full"], tally)()
    assert isinstance(kit, EngineMachine)
    kit.arrive(token_ids=P9[:8], cache_salt=None)
    kit.step(sampled=0, finishing=frozenset())
    assert tally.declared["events_stored_twice"] == 0
    kit.arrive(token_ids=P9[:8], cache_salt=None)
    kit.step(sampled=0, finishing=frozenset())
    assert tally.declared["events_stored_twice"] == 1


def test_transformers_publishes_no_events_so_the_kit_reads_none() -> None:
    assert KV_EVENTS in CONFIGURATIONS["vllm-hybrid"]().supports
    assert KV_EVENTS not in CONFIGURATIONS["transformers-full"]().supports
