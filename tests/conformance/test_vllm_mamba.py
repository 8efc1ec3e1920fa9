"""The ``vllm-mamba`` configuration: vLLM's own scheduler over a full-attention group and
a Mamba group in align mode, driven as its engine core drives it, judged by the spec's
recurrent state group kind (docs/conformance.md, "vLLM's hybrid manager"). Its seeded run
is test_targets.py's, with every bundled configuration."""

from typing import Any

import pytest

from harness.conformance.adapter import DEFERRED, WHOLE_PROMPT, Call
from harness.conformance.targets import configuration

vllm = pytest.importorskip("vllm")

PROMPT = (1, 2, 3, 1, 2, 3, 0, 0, 1, 2, 3, 1, 2)  # 13 tokens


def _engine() -> Any:  # Any: the adapter's vLLM objects
    return configuration("vllm-mamba")()


def _trace(calls: list[Call]) -> list[tuple[str, object]]:
    return [(c.operation, c.args[1] if len(c.args) > 1 else c.args[0]) for c in calls]


def test_it_is_vllms_scheduler_over_a_mamba_group_in_align_mode() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: PLC0415

    engine = _engine()
    scheduler = engine.scheduler
    assert type(scheduler) is Scheduler
    assert scheduler.need_mamba_block_aligned_split  # the scheduler cuts chunks on the grid
    mamba = engine.manager.coordinator.single_type_managers[1]
    assert type(mamba) is MambaManager and mamba.mamba_cache_mode == "align"
    assert mamba.block_size == engine.block_size == engine.group_windows[1].interval
    assert engine.manager.coordinator.retention_interval == engine.block_size


def test_a_long_prompt_is_prefilled_in_chunks_that_end_on_the_grid() -> None:
    engine = _engine()
    engine.submit("r0", PROMPT)
    steps = [_trace(engine.step({"r0": 0}, frozenset())) for _ in range(3)]
    assert (
        steps
        == [
            [("allocate_prompt", PROMPT[:8])],  # the token budget, on the grid
            [("append_token_ids", PROMPT[8:12])],  # to the last boundary below 13
            [("take_copies", "r0"), ("append_token_ids", PROMPT[12:])],  # frees the state at 8
        ]
    )
    # The states at 8 and 12 are cached (checkpoints); the one at 8 is free, still cached.
    mamba = engine.manager.coordinator.single_type_managers[1]
    held = [(p, b.block_hash is not None) for p, b in enumerate(mamba.req_to_blocks["r0"])]
    assert [p for p, cached in held if cached] == [2]
    shown = engine.observe()
    assert len(shown.cached_block_ids[1]) == 2
    assert len(set(shown.cached_block_ids[1]) & set(shown.cached_free_block_ids)) == 1


def test_the_mamba_table_shows_its_running_block_and_null_blocks_anywhere() -> None:
    engine = _engine()
    engine.submit("r0", PROMPT[:5])
    engine.step({"r0": 0}, frozenset())  # [0, 4): the last boundary below 5, checkpointed
    engine.step({"r0": 0}, frozenset({"r0"}))  # [4, 5), then r0 finishes
    engine.submit("r1", (*PROMPT[:4], *[3] * 9))
    calls = engine.step({"r1": 0}, frozenset())  # a hit of 4, then [4, 12) in one chunk
    assert [(c.operation, c.outcome.result) for c in calls] == [("allocate_prompt", 4)]
    blocks = engine.manager.coordinator.single_type_managers[1].req_to_blocks["r1"]
    assert [block.is_null for block in blocks] == [False, True, False]  # a null inside
    shown = engine.observe()
    checkpoint, _, running = (block.block_id for block in blocks)
    assert shown.tables[1]["r1"].block_ids == (running,)
    assert shown.pending_copies == ((checkpoint, running),)
    assert shown.in_flight_block_ids == (checkpoint,)


def test_a_hit_on_a_checkpoint_cached_in_the_same_step_is_a_declared_deferral() -> None:
    engine = _engine()
    engine.submit("r0", (1, 2, 3, 1, 2))  # its first chunk, [0, 4), caches the state at 4
    engine.submit("r1", (1, 2, 3, 1, 3))
    calls = engine.step({"r0": 0, "r1": 0}, frozenset())
    deferred = [c for c in calls if c.args[0] == "r1"]
    assert deferred[0].outcome.refusal is not None
    assert deferred[0].outcome.refusal.startswith(DEFERRED)
    assert "refusal_justified/deferred" in engine.differences
    calls = engine.step({"r0": 0, "r1": 0}, frozenset())  # the next step admits it, hit 4
    admitted = [c for c in calls if c.operation == "allocate_prompt"]
    assert [(c.args[0], c.outcome.result) for c in admitted] == [("r1", 4)]


def test_an_admission_refused_for_its_whole_prompt_is_a_declared_cause() -> None:
    from harness.conformance.targets.vllm_mamba import VLLMMambaEngine  # noqa: PLC0415

    engine = VLLMMambaEngine(total_blocks=5)
    engine.submit("r1", (0, 0, 0))  # one full block and one Mamba block
    engine.submit("r0", PROMPT)  # its first chunk fits in 2 blocks, its whole prompt needs 5
    calls = engine.step({"r0": 0, "r1": 0}, frozenset())
    refused = next(c for c in calls if c.args[0] == "r0")
    assert refused.outcome.refusal == f"{WHOLE_PROMPT}: its whole prompt needs 5 blocks, 3 free"
    assert refused.args[1] == PROMPT[:4]  # the budget r1 left, down to the grid
    assert "refusal_justified/whole_prompt" in engine.differences
