"""The same equivalence on CUDA, float32 and bfloat16 (marked ``cuda``; skipped without one).

Unverified until run on a GPU machine (``scripts/gpu_check.py`` runs the same cases there
without pytest). Check 2 on CUDA needs deterministic kernels: run with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the test turns on ``torch.use_deterministic_algorithms``.
"""

import os
from collections.abc import Iterator

import pytest
import torch

from harness.oracle.device_cases import paged_cache_generate_failures, paged_equals_dense_failures
from harness.runtime.engine import BatchInvariantEngine, Engine

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
