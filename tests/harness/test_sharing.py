"""Sharing on the tiny model: prefix caching, fork with copy-on-write, preemption.

Every run here uses a pool poisoned with NaN up front and on release, so a read of a block
before it is written, of a freed block, or of a copy that never happened ruins the logits.
"""

import random
from collections.abc import Sequence
from dataclasses import replace

import torch

from harness.oracle.checks import (
    CheckResult,
    TokenTrace,
    check_alone,
    check_batch,
    check_gate,
    tie_rule,
)
from harness.oracle.dense import generate_dense_continuation
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PoisonedKVPool
from harness.runtime.requests import Request, RunningRequest, SamplingParams
from harness.runtime.results import EngineResult
from harness.runtime.sampling import continuation_first_tokens
from harness.runtime.step_batch import partial_prefill_mask
from impl import KVCacheManager
from spec import blocks_for_tokens
from tests.support.harness_cases import (
    dense,
    dense_trace,
    make_requests,
    paged_and_contiguous,
    poisoned_pool,
    pool_layout,
    run,
    tiny_model,
    trace,
)

TIE_RULE = tie_rule(torch.float32)


def shared_prefix_requests(count: int, arrival_gap: int, max_new_tokens: int = 6) -> list[Request]:
    """``count`` prompts: one 22-token system prefix, then 3..9 tokens of their own."""
    rng = random.Random(5)
    vocab = tiny_model().model.config.vocab_size
    prefix = tuple(rng.randrange(vocab) for _ in range(22))
    return [
        Request(
            f"r{number}",
            prefix + tuple(rng.randrange(vocab) for _ in range(rng.randint(3, 9))),
            max_new_tokens,
            arrival_step=number * arrival_gap,
        )
        for number in range(count)
    ]


def batched_checks(result: EngineResult, requests: list[Request]) -> list[CheckResult]:
    """Check 3 for every request of ``result``."""
    return [
        check_batch(r.request_id, trace(result, r.request_id), dense_trace(dense(r)), TIE_RULE)
        for r in requests
    ]


def test_a_partial_prefill_mask_is_causal_aligned_to_the_bottom_right() -> None:
    mask = partial_prefill_mask(2, 4, torch.device("cpu"))
    assert mask is not None
    assert mask.tolist() == [[[[True, True, True, False], [True, True, True, True]]]]
    assert partial_prefill_mask(4, 4, torch.device("cpu")) is None  # whole prefill: is_causal
    assert partial_prefill_mask(1, 4, torch.device("cpu")) is None  # one query sees all


def test_requests_sharing_a_prefix_compute_fewer_prefill_tokens_and_emit_generates_tokens() -> None:
    requests = shared_prefix_requests(4, arrival_gap=2)
    cached = run(requests, poisoned_pool(40, 4), KVCacheManager(40, 4))
    uncached = run(requests, poisoned_pool(40, 4), KVCacheManager(40, 4), prefix_caching=False)
    # Each later request reuses the 5 full prefix blocks (20 tokens) the first one cached.
    assert cached.prefix_hit_tokens == 3 * 20
    assert cached.prefill_tokens == uncached.prefill_tokens - 3 * 20
    assert cached.blocks_saved_by_sharing >= 5
    for outcome in batched_checks(cached, requests):
        assert outcome.passed, outcome.detail


class ReversedPackingEngine(Engine):
    """Packs the step's requests last admitted first."""

    def _forward_groups(self, running: list[RunningRequest]) -> list[list[RunningRequest]]:
        return [running[::-1]] if running else []


def test_a_prefix_hit_in_the_step_its_blocks_are_written_reads_them_after_the_write() -> None:
    # Both admitted in step 0: r1's hit blocks are written by r0 in the same forward. In one
    # packed forward every layer writes the whole step before any request reads, so the
    # packing order does not matter; separate forwards run in admission order.
    requests = shared_prefix_requests(2, arrival_gap=0)
    for engine_type in (Engine, BatchInvariantEngine, ReversedPackingEngine):
        result = run(requests, poisoned_pool(20, 4), KVCacheManager(20, 4), engine_type)
        assert result.schedule[0] in (("r0", "r1"), ("r1", "r0"), ("r0",))
        assert result.prefix_hit_tokens == 20
        for outcome in batched_checks(result, requests):
            assert outcome.passed, outcome.detail


def fork_request(num_continuations: int) -> Request:
    """A 10-token prompt (block size 4: its last block is half full, so appends copy it)."""
    rng = random.Random(11)
    vocab = tiny_model().model.config.vocab_size
    prompt = tuple(rng.randrange(vocab) for _ in range(10))
    return Request("p", prompt, 8, num_continuations=num_continuations)


def continuation_references(request: Request) -> dict[str, TokenTrace]:
    """Forced-first-token ``generate`` for every continuation of ``request``, by sequence id."""
    references = {}
    for rank, sequence_id in enumerate(request.sequence_ids):
        reference = generate_dense_continuation(
            tiny_model().model,
            request.prompt_ids,
            request.max_new_tokens,
            None,
            rank=rank,
            num_continuations=request.num_continuations,
        )
        references[sequence_id] = dense_trace(reference)
    return references


def test_three_continuations_fork_copy_on_write_and_each_matches_forced_generate() -> None:
    request = fork_request(3)
    references = continuation_references(request)
    packed = run([request], poisoned_pool(12, 4), KVCacheManager(12, 4))
    alone = run([request], poisoned_pool(12, 4), KVCacheManager(12, 4), BatchInvariantEngine)
    first_tokens = [packed.outputs[s].token_ids[0] for s in request.sequence_ids]
    assert len(set(first_tokens)) == 3
    assert first_tokens == continuation_first_tokens(packed.outputs["p"].logits[0], 3)
    # The half-full prompt block is shared by three: the first two appenders copy it.
    assert packed.cow_copies == 2
    assert alone.cow_copies == 2
    assert packed.blocks_saved_by_sharing >= 2
    for sequence_id, reference in references.items():
        outcome = check_batch(sequence_id, trace(packed, sequence_id), reference, TIE_RULE)
        assert outcome.passed, outcome.detail
        # Each continuation's own forwards (M = 1) compute what generate computes.
        outcome = check_alone(sequence_id, trace(alone, sequence_id), reference)
        assert outcome.passed, outcome.detail


class NoCopyPool(PoisonedKVPool):
    """Planted bug: copy-on-write copies are never made."""

    __slots__ = ()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        pass


def test_without_the_copy_on_write_copy_a_continuation_is_ruined() -> None:
    request = fork_request(3)
    pool = NoCopyPool(pool_layout(), 12, 4)
    pool.poison(list(range(12)))
    result = run([request], pool, KVCacheManager(12, 4))
    references = continuation_references(request)
    failed = [
        sequence_id
        for sequence_id, reference in references.items()
        if not check_batch(sequence_id, trace(result, sequence_id), reference, TIE_RULE).passed
    ]
    # The two copiers lost the prompt's last two tokens; the last writer kept the original.
    assert failed == ["p", "p/1"], failed


def test_a_pool_too_small_for_the_batch_preempts_and_every_request_still_matches() -> None:
    requests = make_requests(6, max_new_tokens=10, arrival_gap=0, seed=3)
    block_size = 4
    largest = max(blocks_for_tokens(block_size, r.max_tokens) for r in requests)
    result = run(requests, poisoned_pool(largest + 2, block_size), KVCacheManager(largest + 2, 4))
    assert result.preemptions > 0
    assert all(len(result.outputs[r.request_id].token_ids) == 10 for r in requests)
    for outcome in batched_checks(result, requests):
        assert outcome.passed, outcome.detail


def test_the_gate_stays_bitwise_through_preemption_and_fork() -> None:
    requests = [*make_requests(4, max_new_tokens=8, arrival_gap=1, seed=4), fork_request(2)]
    largest = max(blocks_for_tokens(4, r.max_tokens) for r in requests)
    paged, contiguous = paged_and_contiguous(
        requests,
        manager_type=KVCacheManager,
        total_blocks=largest + 2,
        block_size=4,
        pool_type=PoisonedKVPool,
    )
    assert paged.preemptions > 0 and paged.cow_copies > 0
    assert paged.schedule == contiguous.schedule
    for request in requests:
        for sequence_id in request.sequence_ids:
            outcome = check_gate(
                sequence_id, trace(paged, sequence_id), trace(contiguous, sequence_id)
            )
            assert outcome.passed, outcome.detail


def test_a_preempted_sampled_request_continues_its_random_stream() -> None:
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    requests = [
        replace(request, sampling=sampling)
        for request in make_requests(5, max_new_tokens=10, arrival_gap=0, seed=3)
    ]
    largest = max(blocks_for_tokens(4, r.max_tokens) for r in requests)
    tight = run(requests, poisoned_pool(largest + 2, 4), KVCacheManager(largest + 2, 4))
    roomy = run(requests, poisoned_pool(64, 4), KVCacheManager(64, 4))
    assert tight.preemptions > 0 and roomy.preemptions == 0
    # Same draws from the same generator: a preempted request does not restart its stream.
    for request in requests:
        request_id = request.request_id
        assert tight.outputs[request_id].token_ids == roomy.outputs[request_id].token_ids


def test_a_copy_is_made_before_a_victim_in_the_same_step_frees_its_source() -> None:
    # Block size 4, pool 5. Step 0 admits "p" (6 tokens, two continuations: blocks 0, 1,
    # the second half full) and "x" (8 tokens: blocks 2, 3); "p/1" forks and runs last.
    # Step 1: "p" appends into shared block 1 and copies it to block 4, the last free one;
    # "x" opens a block, finds none and preempts "p/1", the last admitted, which frees
    # block 1 (poisoned at once) for "x" to take. The copy must already have been made.
    rng = random.Random(2)
    vocab = tiny_model().model.config.vocab_size
    parent = Request("p", tuple(rng.randrange(vocab) for _ in range(6)), 4, num_continuations=2)
    other = Request("x", tuple(rng.randrange(vocab) for _ in range(8)), 4)
    result = run([parent, other], poisoned_pool(5, 4), KVCacheManager(5, 4))
    assert result.schedule[:2] == [("p", "x"), ("p", "x")]
    assert result.cow_copies >= 1 and result.preemptions >= 1
    reference = continuation_references(parent)["p"]
    outcome = check_batch("p", trace(result, "p"), reference, TIE_RULE)
    assert outcome.passed, outcome.detail
    for outcome in batched_checks(result, [other]):
        assert outcome.passed, outcome.detail
