"""The SDPA backends the harness lets torch pick from on CUDA: FlashAttention, the
memory-efficient kernel, MATH, in that order; cuDNN's attention off.

torch 2.11 on an H200 picks cuDNN's attention first for every bfloat16 call the harness
makes (``scripts/gpu_check.py``'s environment stage, 2026-12-04). cuDNN builds an execution
graph for each new shape and caches it by shape (torch keeps the per-length rebuild unless
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, pytorch/pytorch#155958): a bf16 decode call at a key
count not seen before took 37.3 ms there, against FlashAttention's 0.066 ms. Decode grows
every request's key count by one a step, and the paged path calls SDPA once per request, so
nearly every call is a new shape: the bf16 ``Engine`` ran at 13.5 tokens/s with cuDNN and
129.0 with FlashAttention (the check's ``engine_profile`` stage; docs/results.md).

NOTE: cuDNN is switched off, not put last. A priority alone did not hold on the H200: torch
installs its cuDNN-first order on a process's first SDPA dispatch, over an order set just
before, so the first ``sdpa_kernel(..., set_priority=True)`` block of a process ran cuDNN
and later blocks FlashAttention (2026-12-04, docs/gpu/h200-2026-12-04-third.txt). cuDNN's
bits also depend on the K/V layout: in that first block the paged run (a strided view of
the pool) and ``generate`` (a contiguous cache) parted at one request's 16th token, which
is what failed the first bf16 check of a process. An off flag is read at every dispatch,
and MATH takes every call, so nothing is left without a kernel.

So on CUDA every generation the harness runs, the dense reference and the paged ones alike
(the checks still compare like with like), goes through :func:`harness_sdpa_order`. On CPU
it changes nothing.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HARNESS_ORDER: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


@contextlib.contextmanager
def harness_sdpa_order(device: torch.device) -> Iterator[None]:
    """SDPA calls inside pick from ``HARNESS_ORDER``, in that order, on CUDA (cuDNN off)."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(list(HARNESS_ORDER), set_priority=True):
        yield


def describe_order() -> str:
    """``HARNESS_ORDER`` in words, for logs and reports."""
    return " > ".join(backend.name for backend in HARNESS_ORDER) + " (CUDNN_ATTENTION off)"
