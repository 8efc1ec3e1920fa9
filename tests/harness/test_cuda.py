"""The same equivalence on CUDA, float32 and bfloat16 (marked ``cuda``; skipped without one).

Unverified until run on a GPU machine (``scripts/gpu_check.py`` runs the same cases there
without pytest). Check 2 on CUDA needs deterministic kernels: run with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the test turns on ``torch.use_deterministic_algorithms``.
"""

import os
from collections.abc import Iterator

import pytest
import torch

from harness.kv_layout import KVLayout
from harness.oracle.device_cases import paged_cache_generate_failures, paged_equals_dense_failures
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PagedKVPool
from impl import Transfers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
def test_paged_equals_dense_on_cuda(dtype: torch.dtype, engine_type: type[Engine]) -> None:
    failures = paged_equals_dense_failures(CUDA, dtype, engine_type)
    assert not failures, failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_a_paged_cache_is_bit_identical_on_cuda(dtype: torch.dtype) -> None:
    failures = paged_cache_generate_failures(CUDA, dtype)
    assert not failures, failures


def test_the_host_tier_is_pinned_and_a_round_trip_through_it_keeps_every_bit() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device=CUDA)
    pool = PagedKVPool(layout, total_blocks=6, block_size=4, host_blocks=4)
    assert pool.host.pinned and pool.host.keys[0].is_pinned()
    for tensor in pool.keys + pool.values:
        tensor.copy_(torch.randn(tensor.shape, device=CUDA).to(torch.bfloat16))
    before = [tensor[[1, 4]].clone() for tensor in pool.keys + pool.values]
    pool.transfer(Transfers(device_to_host=((1, 0), (4, 3)), host_to_device=()))
    pool.transfer(Transfers(device_to_host=(), host_to_device=((0, 2), (3, 5))))
    after = [tensor[[2, 5]] for tensor in pool.keys + pool.values]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
