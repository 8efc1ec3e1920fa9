"""Architectures beyond Llama on the paged pool: each tiny seeded model passes the three
checks with both engines (prefix hits, forks and preemption on a tight, poisoned pool), and
``PagedCache`` under ``generate`` is bit-identical to HF's own cache.

Each architecture brings a feature the attention hook must carry through unchanged: Qwen2
biases on q/k/v, Qwen3 q/k norms and its own head_dim, Phi-3 a fused qkv projection.
"""

import random

import pytest
import torch

from harness.models import check_supported, tiny_model
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.engine import BatchInvariantEngine, Engine, Request
from harness.runtime.kv_pool import PoisonedKVPool
from tests.support.device_cases import paged_cache_generate_failures

ARCHITECTURES = ["qwen2", "qwen3", "phi3"]


def _requests(vocab: int) -> list[Request]:
    """Six staggered requests behind a shared 8-token prefix (two full blocks of 4), every
    other one asking for two continuations (a fork after its prefill)."""
    rng = random.Random(1)
    prefix = tuple(rng.randrange(vocab) for _ in range(8))
    return [
        Request(
            f"r{number}",
            prefix + tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 30))),
            10,
            arrival_step=number,
            num_continuations=1 + number % 2,
        )
        for number in range(6)
    ]


@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_three_checks_pass_on_a_tiny_model_of_each_architecture(
    architecture: str, engine_type: type[Engine]
) -> None:
    loaded = tiny_model(architecture, seed=0)
    check_supported(loaded.model)
    pool = PoolConfig(
        total_blocks=24, block_size=4, engine_type=engine_type, pool_type=PoisonedKVPool
    )
    report = run_equivalence(
        loaded, _requests(loaded.model.config.vocab_size), pool, lambda _: None
    )
    failures = [
        check.detail
        for row in report.rows
        for check in (row.gate, row.alone, row.batch)
        if not check.passed
    ]
    assert failures == []
    assert report.schedules_equal
    # The run went through every sharing path: hits, copies after forks, preemption.
    assert report.prefix_hit_tokens > 0
    assert report.cow_copies > 0
    assert report.preemptions > 0


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_paged_cache_under_generate_is_bit_identical_for_each_architecture(
    architecture: str,
) -> None:
    failures = paged_cache_generate_failures(torch.device("cpu"), torch.float32, architecture)
    assert failures == []
