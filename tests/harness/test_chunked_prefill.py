"""Chunked prefill (a per-step token budget) on the tiny model: the same tokens as whole
prefills, whatever the chunk boundaries, prefix hits and preemptions.

Every run uses a pool poisoned up front and on release, so a chunk that reads K/V its
prompt never wrote, or a block freed under it, ruins the logits.
"""

import random
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from harness.oracle.checks import TokenTrace, check_batch, check_gate, tie_rule
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.events import PoolEvent
from harness.runtime.requests import Request, RunningRequest
from harness.runtime.results import EngineResult
from harness.runtime.scheduler import Scheduler, Scheduling
from impl import AppendedSlots, KVCacheManager
from tests.support.harness_cases import (
    dense,
    dense_trace,
    poisoned_pool,
    pool_layout,
    tiny_model,
    trace,
)

BLOCK_SIZE = 4
TIE_RULE = tie_rule(torch.float32)
MAX_STEPS = 400  # far more than any run here takes; a planted bug may never finish


class ChunkRecorder(KVCacheManager):
    """A correct manager that records each request's token count after every prompt
    allocation and every append (the chunk boundaries, and decode tokens past the prompt)."""

    def __init__(self, total_blocks: int, block_size: int = 16) -> None:
        super().__init__(total_blocks, block_size)
        self.boundaries: dict[str, list[int]] = {}
        self.hits: dict[str, list[int]] = {}

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        allocation = super().allocate(request_id, tokens, cache_salt)
        self.boundaries.setdefault(request_id, []).append(allocation.token_count)
        self.hits.setdefault(request_id, []).append(allocation.cached_tokens)
        return allocation

    def append(self, request_id: str, tokens: int | Sequence[int] = 1) -> AppendedSlots:
        step = super().append(request_id, tokens)
        self.boundaries.setdefault(request_id, []).append(step.token_count)
        return step


class PreemptRecorder(Engine):
    """The engine, remembering whether each preempted request was mid-prefill."""

    mid_prefill: ClassVar[list[bool]] = []

    def _preempt(self, victim: RunningRequest, waiting: deque[RunningRequest]) -> None:
        self.mid_prefill.append(victim.prefill and victim.computed > 0)
        super()._preempt(victim, waiting)


class BudgetRecorder(Engine):
    """The engine, remembering how many tokens each forward fed."""

    fed: ClassVar[list[int]] = []

    def _forward(
        self, group: list[RunningRequest], grown: dict[str, AppendedSlots]
    ) -> torch.Tensor:
        self.fed.append(sum(len(r.pending_ids) for r in group))
        return super()._forward(group, grown)


def stop_runaway(event: PoolEvent, manager: KVCacheManager) -> None:
    """An observer that ends a run stuck in a loop (as a planted bug may leave it)."""
    if event.step > MAX_STEPS:
        raise RuntimeError(f"still running after {MAX_STEPS} steps")


def long_prompt_requests(count: int, seed: int, prefix: int = 0) -> list[Request]:
    """``count`` prompts of 9..30 tokens (after a shared ``prefix`` of that many), one a step."""
    rng = random.Random(seed)
    vocab = tiny_model().model.config.vocab_size
    shared = tuple(rng.randrange(vocab) for _ in range(prefix))
    return [
        Request(
            f"r{number}",
            shared + tuple(rng.randrange(vocab) for _ in range(rng.randint(9, 30))),
            6,
            arrival_step=number,
        )
        for number in range(count)
    ]


def run_chunked(
    requests: list[Request],
    total_blocks: int,
    budget: int | None,
    engine_type: type[Engine] = Engine,
    *,
    prefix_caching: bool = True,
) -> tuple[EngineResult, ChunkRecorder]:
    manager = ChunkRecorder(total_blocks, BLOCK_SIZE)
    engine = engine_type(
        tiny_model().model,
        manager,
        poisoned_pool(total_blocks, BLOCK_SIZE),
        None,
        prefix_caching=prefix_caching,
        observer=stop_runaway,
        scheduling=Scheduling(max_batch_tokens=budget),
    )
    return engine.run(requests), manager


_DENSE: dict[Request, TokenTrace] = {}


def assert_generates_tokens(result: EngineResult, requests: list[Request]) -> None:
    """Check 3 (``generate``'s tokens, or a divergence at a near-tie) for every request."""
    for request in requests:
        if request not in _DENSE:
            _DENSE[request] = dense_trace(dense(request))
        reference = _DENSE[request]
        outcome = check_batch(
            request.request_id, trace(result, request.request_id), reference, TIE_RULE
        )
        assert outcome.passed, outcome.detail


def roomy(requests: list[Request]) -> int:
    return sum(r.blocks_needed(BLOCK_SIZE) for r in requests) + 4


@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
def test_prompts_prefilled_in_chunks_of_a_small_budget_emit_generates_tokens(
    engine_type: type[Engine],
) -> None:
    requests = long_prompt_requests(4, seed=1)
    result, manager = run_chunked(requests, roomy(requests), budget=7, engine_type=engine_type)
    chunks = {r.request_id: result.outputs[r.request_id].prefill_chunks for r in requests}
    assert max(chunks.values()) >= 3, chunks  # a prompt needing several chunks
    # A chunk boundary inside a block (7 is no multiple of 4).
    assert any(
        count % BLOCK_SIZE and count < len(r.prompt_ids)
        for r in requests
        for count in manager.boundaries[r.request_id]
    )
    assert all(len(output.token_ids) == 6 for output in result.outputs.values())
    assert_generates_tokens(result, requests)


def test_a_step_feeds_at_most_the_budget_decodes_first() -> None:
    requests = long_prompt_requests(4, seed=2)
    BudgetRecorder.fed.clear()
    result, _ = run_chunked(requests, roomy(requests), budget=5, engine_type=BudgetRecorder)
    assert max(BudgetRecorder.fed) == 5
    assert_generates_tokens(result, requests)


def test_a_prefix_hit_skips_the_chunks_it_covers() -> None:
    # r1..r3 arrive after r0 cached the 16-token shared prefix: their first chunk starts
    # after the hit, so they feed (and chunk) fewer tokens.
    requests = long_prompt_requests(4, seed=3, prefix=16)
    requests = [
        Request(r.request_id, r.prompt_ids, r.max_new_tokens, arrival_step=8 * n)
        for n, r in enumerate(requests)
    ]
    result, manager = run_chunked(requests, roomy(requests), budget=6)
    assert result.prefix_hit_tokens == 3 * 16
    for request in requests[1:]:
        # Allocated as prompt[:hit + chunk]: the hit is the whole prompt's.
        assert manager.hits[request.request_id][0] == 16
        assert 16 < manager.boundaries[request.request_id][0] <= 16 + 6
        hit_chunks = result.outputs[request.request_id].prefill_chunks
        assert hit_chunks < -(-len(request.prompt_ids) // 6)
    assert result.prefill_tokens == sum(len(r.prompt_ids) for r in requests) - 3 * 16
    assert_generates_tokens(result, requests)


def test_preemption_in_the_middle_of_a_chunked_prefill_recomputes_correctly() -> None:
    requests = [
        Request(r.request_id, r.prompt_ids, 6, arrival_step=0)
        for r in long_prompt_requests(4, seed=4)
    ]
    tight = max(r.blocks_needed(BLOCK_SIZE) for r in requests) + 1
    PreemptRecorder.mid_prefill.clear()
    result, _ = run_chunked(requests, tight, budget=6, engine_type=PreemptRecorder)
    assert any(PreemptRecorder.mid_prefill), PreemptRecorder.mid_prefill
    assert_generates_tokens(result, requests)


def test_the_gate_stays_bitwise_with_chunked_prefill() -> None:
    requests = long_prompt_requests(4, seed=5)
    tight = max(r.blocks_needed(BLOCK_SIZE) for r in requests) + 2
    scheduling = Scheduling(max_batch_tokens=7)
    paged, _ = run_chunked(requests, tight, budget=7, prefix_caching=False)
    contiguous = Engine(
        tiny_model().model,
        KVCacheManager(tight, BLOCK_SIZE),
        ContiguousKVBuffers(pool_layout(), max(r.max_tokens for r in requests)),
        None,
        prefix_caching=False,
        scheduling=scheduling,
    ).run(requests)
    assert paged.schedule == contiguous.schedule
    for request in requests:
        request_id = request.request_id
        outcome = check_gate(request_id, trace(paged, request_id), trace(contiguous, request_id))
        assert outcome.passed, outcome.detail


# -- planted bugs ------------------------------------------------------------------------


class RecountsHitScheduler(Scheduler):
    """Planted bug: a prefix hit is counted as computed twice, so the chunk after the
    first starts past tokens nobody fed."""

    def admit(self, waiting: RunningRequest, budget: int) -> AppendedSlots | None:
        admitted = super().admit(waiting, budget)
        if admitted is not None:
            waiting.computed *= 2
        return admitted


class RecountsHitEngine(Engine):
    """The engine with ``RecountsHitScheduler``."""

    scheduler_type = RecountsHitScheduler


class SkipsAChunkEngine(Engine):
    """Planted bug: after the first chunk, the next one is allocated and counted as
    computed but never fed (its slots hold whatever the pool had: NaN here)."""

    def _chunk_done(self, running: RunningRequest) -> None:
        super()._chunk_done(running)
        start = running.computed
        skipped = min(len(running.pending_ids), len(running.prefill_ids) - start - 1)
        if running.output.prefill_chunks == 1 and skipped > 0:
            chunk = running.prefill_ids[start : start + skipped]
            self.manager.append(running.request.request_id, chunk)
            running.computed += skipped


@pytest.mark.parametrize("bug", [RecountsHitEngine, SkipsAChunkEngine])
def test_a_chunk_fed_from_the_wrong_place_is_caught(bug: type[Engine]) -> None:
    requests = long_prompt_requests(4, seed=3, prefix=16)
    requests = [
        Request(r.request_id, r.prompt_ids, r.max_new_tokens, arrival_step=8 * n)
        for n, r in enumerate(requests)
    ]
    result, _ = run_chunked(requests, roomy(requests), budget=6, engine_type=bug)
    with pytest.raises(AssertionError, match="paged token"):
        assert_generates_tokens(result, requests)
