"""The engine's conversation with the manager, counted: a decode step of N running requests
makes N + 2 manager calls (one ``append`` each, one ``take_transfers``, one ``usage``), and
no part the engine uses calls back into it.

The calls are recorded by a manager that logs every public call, with each step's end
(the observer's ``step`` event) marking the log; a step whose segment admits, releases,
preempts or forks nothing is a decode step. The running requests at each step are read off
the same log (allocated and not yet released).
"""

import ast
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType, MethodType
from typing import Any

import pytest

import harness.runtime
from harness.models import kv_layout
from harness.runtime.engine import Engine
from harness.runtime.events import PoolEvent
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.requests import Request, RunningRequest
from harness.runtime.scheduler import Scheduler
from harness.tiny_models import tiny_model
from impl import AppendedSlots, KVCacheManager
from impl.block_pool import BlockPool

BLOCK_SIZE = 4
TOTAL_BLOCKS = 64
STEP = "<step>"


class CountingManager(KVCacheManager):
    """A correct manager that logs every public call: its name and first argument."""

    def __init__(self, total_blocks: int, block_size: int = 16, **kwargs: Any) -> None:
        super().__init__(total_blocks, block_size, **kwargs)
        self.calls: list[tuple[str, object]] = []

    def __getattribute__(self, name: str) -> Any:  # Any: whatever the attribute is
        attribute = super().__getattribute__(name)
        calls = super().__getattribute__("__dict__").get("calls")
        if name.startswith("_") or calls is None or not isinstance(attribute, MethodType):
            return attribute

        def counted(*args: object, **kwargs: object) -> object:
            calls.append((name, args[0] if args else None))
            return attribute(*args, **kwargs)

        return counted


def run_tiny(
    architecture: str,
    manager_type: type[KVCacheManager],
    engine_type: type[Engine] = Engine,
    *,
    prefix_caching: bool = True,
) -> KVCacheManager:
    """Three requests of different lengths on a roomy pool; the manager they ran on."""
    loaded = tiny_model(architecture, seed=0)
    layout = kv_layout(loaded)
    rng = random.Random(5)
    requests = [
        Request(f"r{n}", tuple(rng.randrange(256) for _ in range(9 + 5 * n)), 4 + 3 * n)
        for n in range(3)
    ]
    manager = manager_type(TOTAL_BLOCKS, BLOCK_SIZE, group_windows=layout.group_windows)

    def mark_steps(event: PoolEvent, _: KVCacheManager) -> None:
        if event.kind == "step" and isinstance(manager, CountingManager):
            manager.calls.append((STEP, event.step))

    pool = PagedKVPool(layout, TOTAL_BLOCKS, BLOCK_SIZE)
    engine_type(
        loaded.model, manager, pool, None, prefix_caching=prefix_caching, observer=mark_steps
    ).run(requests)
    return manager


def run_logged(
    architecture: str, engine_type: type[Engine] = Engine, *, prefix_caching: bool = True
) -> list[tuple[str, object]]:
    """``run_tiny`` on a ``CountingManager``; its call log."""
    manager = run_tiny(architecture, CountingManager, engine_type, prefix_caching=prefix_caching)
    assert isinstance(manager, CountingManager)
    return manager.calls


# The calls that admit, end or share a request: a step with one of them is no decode step.
LIFECYCLE = {"allocate", "cached_prefix_tokens", "release", "preempt", "fork", "swap_out"}


def decode_steps(calls: list[tuple[str, object]]) -> list[tuple[int, list[str]]]:
    """Each decode step's running request count and its calls, in order."""
    steps: list[tuple[int, list[str]]] = []
    running: set[object] = set()
    segment: list[tuple[str, object]] = []
    for name, argument in calls:
        if name != STEP:
            segment.append((name, argument))
            continue
        names = [call for call, _ in segment]
        if not LIFECYCLE & set(names):
            steps.append((len(running), names))
        for call, request_id in segment:
            if call == "allocate":
                running.add(request_id)
            elif call == "release":
                running.discard(request_id)
        segment = []
    return steps


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_decode_step_of_n_requests_makes_n_plus_two_manager_calls(
    architecture: str, prefix_caching: bool
) -> None:
    steps = decode_steps(run_logged(architecture, prefix_caching=prefix_caching))
    assert {count for count, _ in steps} >= {1, 2, 3}  # steps with each number running
    for count, names in steps:
        assert names == ["append"] * count + ["take_transfers", "usage"]


class AsksForTablesAgainEngine(Engine):
    """Planted: the step asks for each request's tables again after its append."""

    def _forward(self, group: list[RunningRequest], grown: dict[str, AppendedSlots]) -> Any:
        for running in group:
            self.manager.tables(running.request.request_id)
        return super()._forward(group, grown)


def test_a_step_that_asks_for_its_tables_again_is_caught() -> None:
    steps = decode_steps(run_logged("llama", AsksForTablesAgainEngine))
    with pytest.raises(AssertionError):
        for count, names in steps:
            assert names == ["append"] * count + ["take_transfers", "usage"]


def test_the_counter_sees_calls_made_through_bound_methods() -> None:
    manager = CountingManager(8, BLOCK_SIZE)
    allocate: Callable[[str, int], object] = manager.allocate
    allocate("a", 3)
    manager.append("a", 2)
    assert manager.calls == [("allocate", "a"), ("append", "a")]


# -- nothing the engine uses calls back into it --------------------------------------------

RUNTIME = Path(harness.runtime.__file__).parent


def test_no_module_of_the_runtime_but_the_engine_imports_the_engine() -> None:
    importers = []
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "harness.runtime.engine":
                importers.append(path.name)
    assert importers == []


def engine_calls_from_helpers(engine_type: type[Engine]) -> list[str]:
    """Run the tiny model through ``engine_type``; every call of an ``Engine`` method made
    from outside the engine (a helper calling back into it), but its making and ``run``."""
    engine_file = str(RUNTIME / "engine.py")
    methods = {
        function.__code__
        for klass in engine_type.__mro__
        for function in vars(klass).values()
        if callable(function) and hasattr(function, "__code__")
    }
    found: list[str] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        entry = frame.f_code.co_name in {"run", "__init__"}  # the caller builds it, runs it
        if event != "call" or frame.f_code not in methods or entry:
            return
        caller = frame.f_back
        if caller is None or caller.f_code in methods:
            return
        if caller.f_code.co_filename != engine_file:
            found.append(f"{caller.f_code.co_qualname} -> {frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run_logged("llama", engine_type)
    finally:
        sys.setprofile(None)
    return found


def test_no_helper_calls_a_method_of_the_engine() -> None:
    assert engine_calls_from_helpers(Engine) == []


class _CallsBackScheduler(Scheduler):
    engine: Engine

    def grow(
        self,
        running: list[RunningRequest],
        scheduled: list[RunningRequest],
        grown: dict[str, AppendedSlots],
    ) -> RunningRequest | None:
        self.engine._notify("step")  # a helper reaching back into the engine
        return super().grow(running, scheduled, grown)


class CalledBackEngine(Engine):
    """Planted: the scheduler holds the engine and calls one of its methods."""

    scheduler_type = _CallsBackScheduler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.scheduler, _CallsBackScheduler)
        self.scheduler.engine = self


def test_a_helper_that_calls_back_into_the_engine_is_caught() -> None:
    assert any("-> _notify" in call for call in engine_calls_from_helpers(CalledBackEngine))


# -- a decode step's depth: the engine's loop to the block pool ----------------------------

# vLLM v1: ``Scheduler.schedule -> KVCacheManager.allocate_slots -> coordinator ->
# single-type manager -> BlockPool.get_new_blocks`` (5); nano-vllm: ``Scheduler.schedule ->
# BlockManager.may_append -> _allocate_block`` (3).
MAX_DECODE_FRAMES = 5


def decode_take_chains(architecture: str, *, prefix_caching: bool) -> list[list[str]]:
    """Run ``run_tiny``'s requests on a plain ``KVCacheManager`` (blocks of 4, so decodes
    cross into new blocks); for each ``BlockPool.take`` an ``append`` reaches, the frames
    from the engine's loop down.

    Counted: every frame strictly below ``Engine.run`` (the frame of the step loop that a
    caller's ``run`` enters once: each step's growth is called from it), down to and
    including ``BlockPool.take`` (where a decode's new block leaves the pool); the first
    is the frame ``Engine.run`` calls.
    """
    run_code = Engine.run.__code__
    original_take = BlockPool.take
    chains: list[list[str]] = []

    def take(pool: BlockPool, count: int, group: int) -> list[int]:
        chain = ["BlockPool.take"]
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code is not run_code:
            chain.append(frame.f_code.co_qualname)
            frame = frame.f_back
        if frame is not None and "KVCacheManager.append" in chain:
            chains.append(chain[::-1])
        return original_take(pool, count, group)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockPool, "take", take)
        run_tiny(architecture, KVCacheManager, prefix_caching=prefix_caching)
    return chains


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_decode_step_reaches_the_block_pool_in_at_most_five_frames(
    architecture: str, prefix_caching: bool
) -> None:
    chains = decode_take_chains(architecture, prefix_caching=prefix_caching)
    assert chains  # decodes crossed into new blocks
    deepest = max(chains, key=len)
    assert len(deepest) <= MAX_DECODE_FRAMES, " -> ".join(["Engine.run", *deepest])
