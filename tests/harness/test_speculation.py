"""Speculative decoding: the prompt-lookup proposer, and the engine emitting greedy tokens.

The engine runs use a pool poisoned up front and on release (and on rollback), the tiny
model, and prompts that repeat their context, so drafts are both accepted and rejected.
Greedy speculative decoding must emit the very tokens one-token decoding emits.
"""

import random
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.requests import Request, RunningRequest, SamplingParams
from harness.runtime.results import EngineResult
from harness.runtime.scheduler import Scheduler, Scheduling
from harness.runtime.speculation import MAX_NGRAM, accepted_tokens, propose_drafts
from impl import KVCacheManager
from spec import blocks_for_tokens
from tests.support.harness_cases import (
    poisoned_pool,
    pool_layout,
    repeating_requests,
    tiny_model,
)

TOKENS = st.lists(st.integers(0, 5), max_size=30)


# -- the proposer ------------------------------------------------------------------------


@given(TOKENS, st.integers(0, 6))
def test_drafts_are_what_followed_an_earlier_occurrence_of_a_suffix(
    token_ids: list[int], max_drafts: int
) -> None:
    drafts = propose_drafts(token_ids, max_drafts)
    assert len(drafts) <= max_drafts
    if not drafts:
        return
    length = len(token_ids)
    sources = [
        (ngram, start)
        for ngram in range(1, MAX_NGRAM + 1)
        for start in range(length - ngram)
        if token_ids[start : start + ngram] == token_ids[length - ngram :]
        and token_ids[start + ngram : start + ngram + len(drafts)] == drafts
    ]
    assert sources, f"{drafts} follows no earlier occurrence of a suffix of {token_ids}"


@given(TOKENS, st.integers(1, 6))
def test_the_longest_suffix_that_recurs_is_matched_at_its_latest_occurrence(
    token_ids: list[int], max_drafts: int
) -> None:
    length = len(token_ids)
    for ngram in range(min(MAX_NGRAM, length - 1), 0, -1):
        suffix = token_ids[length - ngram :]
        starts = [s for s in range(length - ngram) if token_ids[s : s + ngram] == suffix]
        if starts:
            follow = max(starts) + ngram
            assert propose_drafts(token_ids, max_drafts) == token_ids[follow:][:max_drafts]
            return
    assert propose_drafts(token_ids, max_drafts) == []


@given(st.integers(2, 12), st.integers(1, 11), st.integers(1, 5))
def test_a_repeated_text_proposes_its_continuation(length: int, repeated: int, k: int) -> None:
    text = list(range(100, 100 + length))
    repeated = min(repeated, length - 1)
    quoting = text + text[:repeated]
    # The drafts run on into the quote itself once the text is used up.
    assert propose_drafts(quoting, k) == quoting[repeated : repeated + k]


@given(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), min_size=1))
def test_acceptance_keeps_the_agreeing_drafts_and_the_models_next_token(
    drafts: list[int], greedy_tail: list[int]
) -> None:
    greedy = (greedy_tail * (len(drafts) + 1))[: len(drafts) + 1]
    emitted = accepted_tokens(drafts, greedy)
    accepted = len(emitted) - 1
    assert emitted == greedy[: accepted + 1]  # always greedy's own tokens
    assert drafts[:accepted] == greedy[:accepted]
    assert accepted == len(drafts) or drafts[accepted] != greedy[accepted]


# -- the engine ------------------------------------------------------------------------


class GuessingScheduler(Scheduler):
    """The scheduler with drafts from a known greedy run instead of prompt lookup: the true
    next tokens, one of them wrong where a seeded draw puts it (or none), so that whole
    runs of drafts are accepted and partial ones rejected on a model that never repeats
    its context (the tiny model's random weights do not)."""

    reference: ClassVar[dict[str, list[int]]] = {}

    def drafts(self, running: RunningRequest, budget: int) -> list[int]:
        count = self.draft_count(running, budget)
        request_id = running.request.request_id
        done = len(running.output.token_ids)
        drafts = list(self.reference[request_id][done : done + count])
        wrong = random.Random(f"{request_id}/{done}").randint(0, 2 * count)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 256
        return drafts


def guessing(engine_type: type[Engine], reference: EngineResult) -> type[Engine]:
    """``engine_type`` drafting from ``reference``'s tokens (``GuessingScheduler``)."""
    scheduler = type("Guessing", (GuessingScheduler,), {"reference": token_ids(reference)})
    return type(f"Guessing{engine_type.__name__}", (engine_type,), {"scheduler_type": scheduler})


def run_engine(
    requests: list[Request],
    *,
    total_blocks: int,
    scheduling: Scheduling,
    engine_type: type[Engine] = Engine,
    prefix_caching: bool = True,
    eos_token_id: int | None = None,
) -> EngineResult:
    """``requests`` on a poisoned pool of ``total_blocks`` blocks of 4 tokens."""
    manager = KVCacheManager(total_blocks, 4)
    engine = engine_type(
        tiny_model().model,
        manager,
        poisoned_pool(total_blocks, 4),
        eos_token_id,
        prefix_caching=prefix_caching,
        scheduling=scheduling,
    )
    return engine.run(requests)


_PLAIN_RUNS: dict[type[Engine], EngineResult] = {}


def plain_run(engine_type: type[Engine]) -> EngineResult:
    """``repeating_requests(4, 16)`` without speculation on a roomy pool (run once each)."""
    if engine_type not in _PLAIN_RUNS:
        requests = repeating_requests(4, 16)
        _PLAIN_RUNS[engine_type] = run_engine(
            requests, total_blocks=roomy(requests), scheduling=Scheduling(), engine_type=engine_type
        )
    return _PLAIN_RUNS[engine_type]


def guessed_run(engine_type: type[Engine], prefix_caching: bool) -> EngineResult:
    """``plain_run``'s requests with up to 4 drafts a decode, on the same pool."""
    requests = repeating_requests(4, 16)
    return run_engine(
        requests,
        total_blocks=roomy(requests),
        scheduling=Scheduling(speculate=4),
        engine_type=engine_type,
        prefix_caching=prefix_caching,
    )


def token_ids(result: EngineResult) -> dict[str, list[int]]:
    return {request_id: output.token_ids for request_id, output in result.outputs.items()}


def roomy(requests: Sequence[Request]) -> int:
    return sum(r.blocks_needed(4) for r in requests) + 4


@pytest.mark.parametrize(
    ("engine_type", "prefix_caching"),
    [(Engine, True), (Engine, False), (BatchInvariantEngine, True)],
)
def test_speculative_decoding_emits_the_tokens_of_one_token_decoding(
    engine_type: type[Engine], prefix_caching: bool
) -> None:
    plain = plain_run(engine_type)
    speculative = guessed_run(guessing(engine_type, plain), prefix_caching)
    counts = speculative.speculation
    assert 0 < counts.accepted_drafts < counts.proposed_drafts  # accepted and rejected
    assert counts.tokens_per_forward > 1.0
    assert plain.speculation.proposed_drafts == 0
    assert plain.speculation.tokens_per_forward == 1.0
    assert token_ids(speculative) == token_ids(plain)


def test_prompt_lookup_drafts_on_quoting_prompts_are_verified_and_emit_the_same_tokens() -> None:
    requests = repeating_requests(4, max_new_tokens=16)
    blocks = roomy(requests)
    plain = plain_run(Engine)
    speculative = run_engine(requests, total_blocks=blocks, scheduling=Scheduling(speculate=4))
    # The tiny model does not quote its prompt, so its drafts are proposed and rejected.
    assert speculative.speculation.proposed_drafts > 0
    assert token_ids(speculative) == token_ids(plain)


def test_speculation_with_forks_and_preemption_on_a_tight_pool_emits_the_same_tokens() -> None:
    requests = [
        *repeating_requests(4, max_new_tokens=14, seed=8),
        Request("fork", repeating_requests(1, 14, seed=9)[0].prompt_ids, 14, num_continuations=2),
    ]
    tight = max(r.blocks_needed(4) for r in requests) + 1
    plain = run_engine(requests, total_blocks=roomy(requests), scheduling=Scheduling())
    speculative = run_engine(
        requests,
        total_blocks=tight,
        scheduling=Scheduling(speculate=3),
        engine_type=guessing(Engine, plain),
    )
    assert speculative.preemptions > 0
    assert speculative.cow_copies > 0  # the fork's children wrote into what they shared
    assert "fork/1" in speculative.outputs
    assert 0 < speculative.speculation.accepted_drafts < speculative.speculation.proposed_drafts
    assert token_ids(speculative) == token_ids(plain)


def test_an_eos_inside_an_accepted_run_ends_the_request_there() -> None:
    requests = repeating_requests(4, max_new_tokens=16)
    blocks = roomy(requests)
    eos = plain_run(Engine).outputs["r0"].token_ids[9]  # a token r0 emits mid-run
    plain = run_engine(requests, total_blocks=blocks, scheduling=Scheduling(), eos_token_id=eos)
    speculative = run_engine(
        requests,
        total_blocks=blocks,
        scheduling=Scheduling(speculate=4),
        engine_type=guessing(Engine, plain),
        eos_token_id=eos,
    )
    assert len(plain.outputs["r0"].token_ids) < 16
    assert token_ids(speculative) == token_ids(plain)


def test_the_gate_stays_bitwise_with_speculation() -> None:
    requests = repeating_requests(4, max_new_tokens=16)
    tight = max(r.blocks_needed(4) for r in requests) + 2
    scheduling = Scheduling(speculate=3)
    plain = plain_run(Engine)
    engine_type = guessing(Engine, plain)
    paged = run_engine(
        requests,
        total_blocks=tight,
        scheduling=scheduling,
        engine_type=engine_type,
        prefix_caching=False,
    )
    contiguous_engine = engine_type(
        tiny_model().model,
        KVCacheManager(tight, 4),
        ContiguousKVBuffers(pool_layout(), max(r.max_tokens for r in requests)),
        None,
        prefix_caching=False,
        scheduling=scheduling,
    )
    contiguous = contiguous_engine.run(requests)
    assert paged.preemptions > 0
    assert 0 < paged.speculation.accepted_drafts < paged.speculation.proposed_drafts
    assert paged.schedule == contiguous.schedule
    for request_id, output in paged.outputs.items():
        other = contiguous.outputs[request_id]
        assert output.token_ids == other.token_ids
        assert all(a.equal(b) for a, b in zip(output.logits, other.logits, strict=True)), request_id


def test_sampled_requests_do_not_speculate() -> None:
    prompt_ids = repeating_requests(1, 12)[0].prompt_ids
    request = Request("s", prompt_ids, 12, sampling=SamplingParams(1.0))
    result = run_engine([request], total_blocks=20, scheduling=Scheduling(speculate=4))
    assert result.speculation.proposed_drafts == 0
    assert len(result.outputs["s"].token_ids) == 12


def test_a_pool_sized_for_the_requests_never_needs_room_for_drafts_beyond_max_tokens() -> None:
    requests = repeating_requests(1, max_new_tokens=16)
    exact = blocks_for_tokens(4, requests[0].max_tokens)
    result = run_engine(requests, total_blocks=exact, scheduling=Scheduling(speculate=4))
    assert result.preemptions == 0
    assert len(result.outputs["r0"].token_ids) == 16


# -- planted bugs ------------------------------------------------------------------------


class NoRollbackEngine(Engine):
    """Planted bug: rejected drafts stay in the table (no truncate)."""

    def _roll_back(self, running: RunningRequest) -> None:
        pass  # the table keeps the rejected drafts' tokens and K/V


class RollsBackOneShortEngine(Engine):
    """Planted bug: the rollback keeps one rejected draft (truncate one token short)."""

    def _roll_back(self, running: RunningRequest) -> None:
        running.computed += 1
        super()._roll_back(running)


@pytest.mark.parametrize("bug", [NoRollbackEngine, RollsBackOneShortEngine])
def test_a_broken_rollback_changes_the_tokens(bug: type[Engine]) -> None:
    plain = plain_run(Engine)
    broken = guessed_run(guessing(bug, plain), prefix_caching=True)
    assert token_ids(broken) != token_ids(plain)
