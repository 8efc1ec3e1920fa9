"""The same equivalence on CUDA, float32 and bfloat16 (marked ``cuda``; skipped without one).

Unverified until run on a GPU machine (``scripts/gpu_check.sh``). Check 2 on CUDA needs
deterministic kernels: run with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the test turns on
``torch.use_deterministic_algorithms``.
"""

import os
from collections.abc import Iterator

import pytest
import torch

from harness.models import LoadedModel, kv_layout, tiny_llama
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PoisonedKVPool
from harness.runtime.paged_cache import PagedCache
from impl import KVBlockManager
from tests.support.harness_cases import make_requests, poisoned_pool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _tiny_on_cuda(dtype: torch.dtype) -> LoadedModel:
    loaded = tiny_llama(seed=0)
    loaded.model.to(device="cuda", dtype=dtype)
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
def test_paged_equals_dense_on_cuda(dtype: torch.dtype, engine_type: type[Engine]) -> None:
    requests = make_requests(6, max_new_tokens=10, arrival_gap=1)
    pool = PoolConfig(
        num_blocks=24, block_size=4, engine_type=engine_type, pool_type=PoisonedKVPool
    )
    report = run_equivalence(_tiny_on_cuda(dtype), requests, pool, lambda _: None)
    failures = [
        check.detail
        for row in report.rows
        for check in (row.gate, row.alone, row.batch)
        if not check.passed
    ]
    assert report.schedules_equal
    assert not failures, failures
    if engine_type is BatchInvariantEngine:
        assert not any(row.batch.tie for row in report.rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_a_paged_cache_is_bit_identical_on_cuda(dtype: torch.dtype) -> None:
    loaded = _tiny_on_cuda(dtype)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(loaded.model.config.vocab_size, (2, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # row 1 is left-padded
    kwargs = {
        "attention_mask": attention_mask.cuda(),
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    pool = poisoned_pool(32, 4, kv_layout(loaded))
    with torch.no_grad(), PagedCache(KVBlockManager(32, 4), pool, 2) as cache:
        paged = loaded.model.generate(input_ids.cuda(), past_key_values=cache, **kwargs)
        dense = loaded.model.generate(input_ids.cuda(), **kwargs)
    assert torch.equal(paged.sequences, dense.sequences)
    for paged_logits, dense_logits in zip(paged.logits, dense.logits, strict=True):
        assert torch.equal(paged_logits, dense_logits)
