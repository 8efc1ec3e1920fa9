"""Cache salts through the harness: tenants that share a system prompt hit only their own
tenant's blocks, and their tokens still pass the three checks."""

from collections.abc import Sequence

import pytest

import harness
from harness.oracle.equivalence import EquivalenceReport
from impl import AppendedSlots, KVCacheManager
from tests.support.harness_cases import tiny_model

# A 12-token "system prompt" (three blocks of 4) every prompt starts with, then its own tail.
SYSTEM = [5, 9, 13, 2, 7, 30, 31, 8, 11, 12, 14, 15]
PROMPTS = [[*SYSTEM, 40 + number, 41, 42] for number in range(4)]


def _check(salts: int | None) -> EquivalenceReport:
    # A pool that holds every request at once: no preemption, so each hit is an admission's.
    return harness.check_model(
        tiny_model().model,
        None,
        PROMPTS,
        max_new_tokens=5,
        block_size=4,
        total_blocks=32,
        poison_freed=True,
        salts=salts,
        arrival_gap=3,
    )


def _first_hits_per_salt(report: EquivalenceReport) -> dict[str | None, int]:
    """The prefix hit of each salt's first request: anything but 0 came from another salt."""
    first: dict[str | None, int] = {}
    for row in report.rows:
        first.setdefault(row.cache_salt, row.prefix_hit_tokens)
    return first


def test_two_salts_hit_only_within_a_salt_and_pass_the_three_checks() -> None:
    report = _check(salts=2)
    assert report.passed, report.summary()
    assert report.preemptions == 0
    assert [row.cache_salt for row in report.rows] == ["tenant0", "tenant1"] * 2
    # Each tenant's first prompt computes the system prompt; its second hits all 12 tokens.
    assert _first_hits_per_salt(report) == {"tenant0": 0, "tenant1": 0}
    assert [row.prefix_hit_tokens for row in report.rows] == [0, 0, 12, 12]
    assert report.prefix_hit_tokens_by_salt == {"tenant0": 12, "tenant1": 12}
    assert report.prefix_hit_tokens == 24


def test_without_salts_the_second_prompt_hits_the_first_ones_blocks() -> None:
    report = _check(salts=None)
    assert report.passed, report.summary()
    assert [row.prefix_hit_tokens for row in report.rows] == [0, 12, 12, 12]
    assert report.prefix_hit_tokens_by_salt == {}


def test_a_salt_that_never_reaches_the_manager_shows_hits_across_salts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The planted bug of SGLang #23300: the request has a salt, the allocator never sees it.
    allocate, cached_prefix_tokens = KVCacheManager.allocate, KVCacheManager.cached_prefix_tokens

    def allocate_unsalted(
        self: KVCacheManager,
        request_id: str,
        tokens: int | Sequence[int],
        cache_salt: str | None = None,
    ) -> AppendedSlots:
        return allocate(self, request_id, tokens)

    def cached_prefix_tokens_unsalted(
        self: KVCacheManager, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        return cached_prefix_tokens(self, token_ids)

    monkeypatch.setattr(KVCacheManager, "allocate", allocate_unsalted)
    monkeypatch.setattr(KVCacheManager, "cached_prefix_tokens", cached_prefix_tokens_unsalted)
    assert _first_hits_per_salt(_check(salts=2))["tenant1"] == 12
