"""The engine on the tiny model: paged equals dense, and planted allocator bugs show up."""

import pytest
import torch

from harness.oracle.checks import check_alone, check_batch, check_gate, tie_rule
from harness.runtime import engine as engine_module
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from harness.runtime.kv_store import KVPlan
from harness.runtime.requests import Request, SamplingParams
from harness.runtime.sampling import logits_to_host
from impl import KVCacheManager
from spec import blocks_for_tokens
from tests.support.harness_cases import (
    EarlyReleaseEngine,
    RecordingManager,
    SwappedBlockManager,
    dense,
    dense_trace,
    make_requests,
    paged_and_contiguous,
    pool_layout,
    run,
    trace,
)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_one_request_on_scattered_blocks_is_bit_identical_to_generate(block_size: int) -> None:
    (request,) = make_requests(1, max_new_tokens=12, arrival_gap=0, seed=block_size)
    manager = KVCacheManager(64, block_size)
    # Blocks 0..2 go to a request that never runs, so ours start at block 3.
    manager.allocate("filler", 3 * block_size)
    pool = PagedKVPool(pool_layout(), 64, block_size)
    result = run([request], pool, manager)
    reference = dense(request)
    outcome = check_alone(
        request.request_id, trace(result, request.request_id), dense_trace(reference)
    )
    assert outcome.passed, outcome.detail
    assert result.outputs[request.request_id].token_ids == reference.token_ids


def test_a_static_batch_is_bit_identical_to_contiguous_buffers_and_emits_generates_tokens() -> None:
    requests = make_requests(4, max_new_tokens=10, arrival_gap=0)
    paged, contiguous = paged_and_contiguous(
        requests, manager_type=KVCacheManager, total_blocks=64, block_size=8
    )
    assert paged.schedule == contiguous.schedule
    assert paged.schedule[0] == ("r0", "r1", "r2", "r3")  # one packed forward, all four
    for request in requests:
        gate = check_gate(
            request.request_id,
            trace(paged, request.request_id),
            trace(contiguous, request.request_id),
        )
        assert gate.passed, gate.detail
        batched = check_batch(
            request.request_id,
            trace(paged, request.request_id),
            dense_trace(dense(request)),
            tie_rule(torch.float32),
        )
        assert batched.passed and not batched.tie, batched.detail


def test_continuous_batching_on_a_tight_pool_reuses_blocks_and_stays_equivalent() -> None:
    requests = make_requests(8, max_new_tokens=12, arrival_gap=2)
    block_size = 4
    largest = max(blocks_for_tokens(block_size, request.max_tokens) for request in requests)
    paged, contiguous = paged_and_contiguous(
        requests,
        manager_type=RecordingManager,
        total_blocks=largest + 4,
        block_size=block_size,
        pool_type=PoisonedKVPool,
    )
    # The pool is too small for everyone: requests waited, and requests joined a running batch.
    assert max(len(group) for group in paged.schedule) >= 2
    assert paged.peak_requests < len(requests)
    for request in requests:
        request_id = request.request_id
        gate = check_gate(request_id, trace(paged, request_id), trace(contiguous, request_id))
        assert gate.passed, gate.detail
        batched = check_batch(
            request_id,
            trace(paged, request_id),
            dense_trace(dense(request)),
            tie_rule(torch.float32),
        )
        assert batched.passed, batched.detail


def test_blocks_are_handed_to_a_second_request_after_release() -> None:
    requests = make_requests(6, max_new_tokens=8, arrival_gap=1)
    manager = RecordingManager(12, 4)
    run(requests, PoisonedKVPool(pool_layout(), 12, 4), manager)
    reused = [block_id for block_id, holders in manager.holders.items() if len(holders) >= 2]
    assert reused, manager.holders


def test_release_on_finish_returns_every_block() -> None:
    requests = make_requests(5, max_new_tokens=6, arrival_gap=1)
    manager = KVCacheManager(20, 4)
    result = run(requests, PagedKVPool(pool_layout(), 20, 4), manager)
    assert all(len(output.token_ids) == 6 for output in result.outputs.values())
    assert manager.usage().free_blocks == 20
    assert not manager.to_spec().tables
    manager.check_invariants()


def test_an_exception_mid_run_still_releases_the_running_requests() -> None:
    class FailingPool(PagedKVPool):
        __slots__ = ("reads",)

        def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
            self.reads = getattr(self, "reads", 0) + 1
            if self.reads > 10:
                raise RuntimeError("device lost")
            return super().read(layer_idx, plan)

    manager = KVCacheManager(20, 4)
    with pytest.raises(RuntimeError, match="device lost"):
        run(
            make_requests(3, max_new_tokens=20, arrival_gap=0),
            FailingPool(pool_layout(), 20, 4),
            manager,
        )
    assert manager.usage().free_blocks == 20
    manager.check_invariants()


def test_a_corrupted_block_table_makes_paged_diverge_from_contiguous() -> None:
    requests = make_requests(3, max_new_tokens=10, arrival_gap=1)
    paged, contiguous = paged_and_contiguous(
        requests, manager_type=SwappedBlockManager, total_blocks=40, block_size=4
    )
    failures = [
        check_gate(r.request_id, trace(paged, r.request_id), trace(contiguous, r.request_id))
        for r in requests
    ]
    assert not any(outcome.passed for outcome in failures), [f.detail for f in failures]
    tokens_differ = [
        paged.outputs[r.request_id].token_ids != contiguous.outputs[r.request_id].token_ids
        for r in requests
    ]
    assert any(tokens_differ)


def _early_release_runs(
    total_blocks: int, pool_type: type[PagedKVPool]
) -> tuple[list[Request], dict[str, list[int]], dict[str, list[int]]]:
    requests = make_requests(6, max_new_tokens=8, arrival_gap=1)
    block_size = 64  # one block per request: the stale table always covers the next token
    buggy = run(
        requests,
        pool_type(pool_layout(), total_blocks, block_size),
        KVCacheManager(total_blocks, block_size),
        EarlyReleaseEngine,
    )
    correct = run(
        requests, ContiguousKVBuffers(pool_layout(), 64), KVCacheManager(total_blocks, block_size)
    )
    return (
        requests,
        {k: v.token_ids for k, v in buggy.outputs.items()},
        {k: v.token_ids for k, v in correct.outputs.items()},
    )


def test_a_use_after_free_is_invisible_on_a_roomy_pool_without_poison() -> None:
    # Why the poison exists: freed blocks keep their K/V until reused, so a roomy FIFO pool
    # hides the bug completely.
    _, buggy, correct = _early_release_runs(total_blocks=64, pool_type=PagedKVPool)
    assert buggy == correct


def test_a_use_after_free_ruins_the_output_on_a_poisoned_pool() -> None:
    requests, buggy, correct = _early_release_runs(total_blocks=64, pool_type=PoisonedKVPool)
    ruined = [r.request_id for r in requests if buggy[r.request_id] != correct[r.request_id]]
    assert len(ruined) == len(requests), ruined


def test_batch_invariant_mode_makes_continuous_batching_bit_identical_to_generate() -> None:
    requests = make_requests(5, max_new_tokens=8, arrival_gap=1)
    # Room for all five at once: a preempted request's recompute is a partial prefill,
    # which is not bitwise (see tests/harness/test_sharing.py for preemption).
    manager = KVCacheManager(40, 4)
    result = run(requests, PoisonedKVPool(pool_layout(), 40, 4), manager, BatchInvariantEngine)
    assert all(len(group) == 1 for group in result.schedule)
    assert result.preemptions == 0
    for request in requests:
        outcome = check_alone(
            request.request_id, trace(result, request.request_id), dense_trace(dense(request))
        )
        assert outcome.passed, outcome.detail


def test_seeded_sampling_is_reproducible_and_paging_does_not_change_it() -> None:
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    requests = [
        Request(r.request_id, r.prompt_ids, r.max_new_tokens, r.arrival_step, sampling)
        for r in make_requests(3, max_new_tokens=10, arrival_gap=1)
    ]
    paged, contiguous = paged_and_contiguous(
        requests, manager_type=KVCacheManager, total_blocks=40, block_size=4
    )
    again, _ = paged_and_contiguous(
        requests, manager_type=KVCacheManager, total_blocks=40, block_size=4
    )
    greedy = run(
        make_requests(3, max_new_tokens=10, arrival_gap=1),
        PagedKVPool(pool_layout(), 40, 4),
        KVCacheManager(40, 4),
    )
    tokens = {k: v.token_ids for k, v in paged.outputs.items()}
    assert tokens == {k: v.token_ids for k, v in contiguous.outputs.items()}
    assert tokens == {k: v.token_ids for k, v in again.outputs.items()}
    assert tokens != {k: v.token_ids for k, v in greedy.outputs.items()}


def test_a_request_larger_than_the_pool_is_refused_before_anything_runs() -> None:
    (request,) = make_requests(1, max_new_tokens=30, arrival_gap=0)
    manager = KVCacheManager(2, 4)
    with pytest.raises(ValueError, match="needs up to"):
        run([request], PagedKVPool(pool_layout(), 2, 4), manager)
    assert manager.usage().free_blocks == 2


@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_a_pool_of_exactly_the_largest_request_serves_everyone_without_running_dry(
    block_size: int,
) -> None:
    requests = make_requests(6, max_new_tokens=7, arrival_gap=0, seed=block_size)
    largest = max(blocks_for_tokens(block_size, request.max_tokens) for request in requests)
    manager = KVCacheManager(largest, block_size)
    result = run(requests, PoisonedKVPool(pool_layout(), largest, block_size), manager)
    assert [len(result.outputs[r.request_id].token_ids) for r in requests] == [7] * 6
    assert manager.usage().free_blocks == largest


@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
def test_the_engine_copies_logits_to_the_host_once_per_step_however_many_forwards(
    engine_type: type[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[int] = []

    def counting(step_logits: list[torch.Tensor]) -> torch.Tensor:
        copies.append(len(step_logits))
        return logits_to_host(step_logits)

    # The engine calls the name it imported: count the calls there.
    monkeypatch.setattr(engine_module, "logits_to_host", counting)
    requests = make_requests(3, max_new_tokens=5, arrival_gap=0)
    result = run(requests, PagedKVPool(pool_layout(), 32, 4), KVCacheManager(32, 4), engine_type)
    assert len(copies) == len(result.usage)  # one per engine step
    assert max(copies) == (3 if engine_type is BatchInvariantEngine else 1)
    assert all(
        logits.device.type == "cpu"
        for output in result.outputs.values()
        for logits in output.logits
    )
