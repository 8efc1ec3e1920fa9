"""The host tier through the harness: preemption by swap and host prefix hits happen on a
tight pool, and the three checks still pass bitwise with poisoned freed blocks."""

import dataclasses
from collections.abc import Sequence

import pytest

import harness
from harness.oracle.equivalence import EquivalenceReport
from harness.runtime.kv_pool import PoisonedKVPool
from impl import Transfers
from tests.support.harness_cases import make_requests, tiny_model

# Eight staggered prompts of 3..40 tokens, 12 new tokens each, on 4-token blocks: the
# default pool (a quarter of what they need at once) preempts several times.
PROMPTS = [list(request.prompt_ids) for request in make_requests(8, 12, 1, seed=3)]
# A 16-token "system prompt" (four blocks of 4) every prompt starts with, then its own tail.
SYSTEM = [5, 9, 13, 2, 7, 30, 31, 8, 11, 12, 14, 15, 16, 17, 18, 19]


def _swap_run(prompts: Sequence[Sequence[int]] = PROMPTS, **settings: object) -> EquivalenceReport:
    return harness.check_model(
        tiny_model().model,
        None,
        prompts,
        max_new_tokens=12,
        block_size=4,
        poison_freed=True,
        arrival_gap=1,
        preempt="swap",
        **settings,  # type: ignore[arg-type]
    )


def _prefix_run(host_blocks: int | None) -> EquivalenceReport:
    # Requests one at a time on a 12-block pool: the first caches the system prompt's four
    # blocks; the second, unrelated, needs all 12 blocks and evicts them; the third shares
    # the system prompt again and finds it only on the host (if there is one).
    prompts = [
        [*SYSTEM, *range(40, 56)],
        list(range(100, 144)),
        [*SYSTEM, *range(60, 76)],
    ]
    return harness.check_model(
        tiny_model().model,
        None,
        prompts,
        max_new_tokens=4,
        block_size=4,
        total_blocks=12,
        poison_freed=True,
        arrival_gap=8,
        host_blocks=host_blocks,
    )


def test_a_tight_pool_preempts_by_swap_and_passes_the_three_checks() -> None:
    report = _swap_run()
    assert report.passed, report.summary()
    host = report.host
    assert host.swaps_out > 0
    assert host.swaps_in == host.swaps_out  # every swapped request came back
    assert host.recomputes == 0  # the host tier (as many blocks as the pool) took them all
    assert host.recomputed_tokens == 0
    assert host.blocks_to_host > 0
    assert host.blocks_to_device == host.blocks_to_host
    assert report.pool.host_blocks == report.pool.total_blocks


def test_a_host_tier_too_small_for_a_victim_falls_back_to_recompute() -> None:
    report = _swap_run(host_blocks=1)
    assert report.passed, report.summary()
    assert report.host.swaps_out == 0
    assert report.host.recomputes > 0
    assert report.host.recomputed_tokens > 0


def test_recompute_stays_the_default_and_recomputes_what_it_dropped() -> None:
    report = harness.check_model(
        tiny_model().model, None, PROMPTS, max_new_tokens=12, block_size=4, arrival_gap=1
    )
    assert report.passed, report.summary()
    assert report.pool.preemption == "recompute"
    assert report.pool.host_blocks == 0
    assert report.host.swaps_out == 0
    assert report.host.recomputes == report.preemptions > 0
    assert report.host.recomputed_tokens > 0


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier() -> None:
    without = _prefix_run(host_blocks=None)
    assert without.passed, without.summary()
    report = _prefix_run(host_blocks=32)
    assert report.passed, report.summary()
    assert report.pool.host_prefix_cache
    assert [row.prefix_hit_tokens for row in without.rows] == [0, 0, 0]
    # The system prompt's 16 tokens come back from the host: 4 blocks copied to the device.
    assert [row.prefix_hit_tokens for row in report.rows] == [0, 0, 16]
    assert report.host.host_prefix_hit_tokens == 16
    assert report.host.blocks_to_device == 4
    assert report.host.blocks_to_host > 0


def test_poisoning_a_swapped_out_block_before_its_copy_out_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Planted bug: the freed device blocks are poisoned before their copy out is made (the
    # host tier keeps NaN, and the swapped-in request reads it).
    transfer = PoisonedKVPool.transfer

    def poison_first(self: PoisonedKVPool, transfers: Transfers) -> None:
        self.poison([device for device, _ in transfers.device_to_host])
        transfer(self, transfers)

    monkeypatch.setattr(PoisonedKVPool, "transfer", poison_first)
    report = _swap_run()
    assert report.host.swaps_out > 0
    assert not report.passed
    assert any(line.startswith("gate:") for line in report.failures)


def _drop_copies_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the pool never makes a host -> device copy."""
    transfer = PoisonedKVPool.transfer

    def no_copy_in(self: PoisonedKVPool, transfers: Transfers) -> None:
        transfer(self, dataclasses.replace(transfers, host_to_device=()))

    monkeypatch.setattr(PoisonedKVPool, "transfer", no_copy_in)


def test_a_swap_in_whose_copies_are_never_made_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The swapped-in request reads whatever its fresh device blocks held (NaN, in a
    # poisoned pool, once any was freed).
    _drop_copies_in(monkeypatch)
    report = _swap_run()
    assert report.host.swaps_in > 0
    assert not report.passed


def test_a_host_prefix_hit_whose_copy_in_is_never_made_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The third prompt reads its fresh device blocks (poisoned when freed) as its system
    # prompt.
    _drop_copies_in(monkeypatch)
    report = _prefix_run(host_blocks=32)
    assert report.host.host_prefix_hit_tokens == 16
    assert not report.rows[2].batch.passed
