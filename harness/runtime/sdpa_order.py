"""The order in which the harness lets torch pick an SDPA backend on CUDA: cuDNN last.

torch 2.11 on an H200 picks cuDNN's attention first for every bfloat16 call the harness
makes (``scripts/gpu_check.py``'s environment stage, 2026-12-04). cuDNN builds an execution
graph for each new shape and caches it by shape (torch keeps the per-length rebuild unless
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, pytorch/pytorch#155958): a bf16 decode call at a key
count not seen before took 37.3 ms there, against FlashAttention's 0.066 ms. Decode grows
every request's key count by one a step, and the paged path calls SDPA once per request, so
nearly every call is a new shape: the bf16 ``Engine`` ran at 13.5 tokens/s in torch's order
and 129.0 in this one (the check's ``engine_profile`` stage; docs/results.md).

So on CUDA every generation the harness runs, the dense reference and the paged ones alike
(the checks still compare like with like), goes through :func:`harness_sdpa_order`:
FlashAttention, then the memory-efficient kernel, then MATH, and cuDNN only where none of
those takes the call. On CPU it changes nothing.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HARNESS_ORDER: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
)


@contextlib.contextmanager
def harness_sdpa_order(device: torch.device) -> Iterator[None]:
    """SDPA calls inside pick their backend in ``HARNESS_ORDER`` on CUDA (cuDNN last)."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(list(HARNESS_ORDER), set_priority=True):
        yield


def describe_order() -> str:
    """``HARNESS_ORDER`` in words, for logs and reports."""
    return " > ".join(backend.name for backend in HARNESS_ORDER)
