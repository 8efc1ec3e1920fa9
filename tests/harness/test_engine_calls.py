"""The engine asks the manager once per request per decode step, in every KV cache group.

A decode step's one call (``append_token_id_slots`` or ``append_slots``) gives every group's
table and the new tokens' slots; the step computes no allocator arithmetic and asks for no
snapshot, ref count or second group afterwards.
"""

import random
from collections.abc import Callable
from types import MethodType
from typing import Any

import pytest

from harness.models import kv_layout
from harness.runtime.allocation import NO_PREFIX_CACHING, PREFIX_CACHING, Allocation
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.requests import Request
from harness.tiny_models import tiny_model
from impl import KVBlockManager

BLOCK_SIZE = 4
TOTAL_BLOCKS = 64


class CountingManager(KVBlockManager):
    """A correct manager that records the public calls naming a request id, in order."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.calls: list[tuple[str, str]] = []

    def __getattribute__(self, name: str) -> Any:  # Any: whatever the attribute is
        attribute = super().__getattribute__(name)
        calls = super().__getattribute__("__dict__").get("calls")
        if name.startswith("_") or calls is None or not isinstance(attribute, MethodType):
            return attribute

        def counted(*args: object, **kwargs: object) -> object:
            if args and isinstance(args[0], str):
                calls.append((name, args[0]))
            return attribute(*args, **kwargs)

        return counted


def calls_per_request(
    architecture: str, allocation: Allocation, engine_type: type[Engine] = Engine
) -> tuple[dict[str, list[str]], dict[str, int], int]:
    """Three requests at once on a roomy pool: the calls naming each, its tokens, and the
    model's KV cache group count."""
    loaded = tiny_model(architecture, seed=0)
    layout = kv_layout(loaded)
    rng = random.Random(5)
    requests = [
        Request(f"r{n}", tuple(rng.randrange(256) for _ in range(9 + 5 * n)), 7) for n in range(3)
    ]
    manager = CountingManager(TOTAL_BLOCKS, BLOCK_SIZE, group_windows=layout.group_windows)
    pool = PagedKVPool(layout, TOTAL_BLOCKS, BLOCK_SIZE)
    result = engine_type(loaded.model, manager, pool, None, allocation).run(requests)
    calls: dict[str, list[str]] = {r.request_id: [] for r in requests}
    for name, request_id in manager.calls:
        calls[request_id].append(name)
    tokens = {r.request_id: len(result.outputs[r.request_id].token_ids) for r in requests}
    return calls, tokens, len(layout.group_windows)


def assert_one_call_per_decode_step(
    architecture: str,
    allocation: Allocation,
    append: str,
    admit: str,
    engine_type: type[Engine] = Engine,
) -> None:
    """Each request's calls: admission, the prefill's slots, one ``append`` per decode step
    (the first token comes from the prefill), the release, and nothing else but the usage
    sample's one read-only ``snapshot_groups`` per step with several groups."""
    calls, tokens, groups = calls_per_request(architecture, allocation, engine_type)
    for request_id, names in calls.items():
        sampled = [name for name in names if name == "snapshot_groups"]
        allocating = [name for name in names if name != "snapshot_groups"]
        decode_steps = tokens[request_id] - 1
        assert allocating == [admit, "new_token_slots", *[append] * decode_steps, "release_blocks"]
        assert len(sampled) == (decode_steps + 1 if groups > 1 else 0)


APPENDS = [
    (PREFIX_CACHING, "append_token_id_slots", "allocate_prompt"),
    (NO_PREFIX_CACHING, "append_slots", "allocate"),
]


@pytest.mark.parametrize("architecture", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize(("allocation", "append", "admit"), APPENDS)
def test_each_decode_step_asks_the_manager_once_per_request(
    architecture: str, allocation: Allocation, append: str, admit: str
) -> None:
    assert_one_call_per_decode_step(architecture, allocation, append, admit)


class SnapshotsEveryGroupEngine(Engine):
    """Planted: the step asks for each group's table again after the append."""

    def _grow(self, running: Any) -> Any:  # Any: the engine's own records
        step = super()._grow(running)
        for group in range(len(self.manager.group_windows)):
            self.manager.snapshot_request(running.request.request_id, group)
        return step


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_a_step_that_asks_for_its_tables_again_is_caught(architecture: str) -> None:
    with pytest.raises(AssertionError):
        assert_one_call_per_decode_step(
            architecture, *APPENDS[0], engine_type=SnapshotsEveryGroupEngine
        )


def test_the_counter_sees_calls_made_through_bound_methods() -> None:
    manager = CountingManager(8, BLOCK_SIZE)
    allocate: Callable[[str, int], object] = manager.allocate
    allocate("a", 3)
    manager.append_slots("a", 2)
    assert manager.calls == [("allocate", "a"), ("append_slots", "a")]
