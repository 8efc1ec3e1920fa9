"""``--attention varlen``: FlashAttention's paged kernel, ``torch.nn.attention.varlen``.

One ``varlen_attn`` call per layer for the whole packed step (prefills and decodes mixed):
the packed queries, the pool's per-layer pages read in place through ``block_table``, each
request's key count ``seqused_k``, bottom-right causality (``window_size=(-1, 0)``), GQA,
and ``num_splits=1`` (no split-KV, so a request's output does not depend on the batch).

NOTE: untested on a GPU so far: the GPU runs (an H200 with torch 2.11, twice on 2026-12-04)
had a ``varlen_attn`` without a block table, which ``varlen_limits`` refuses in words; the
emulator (``harness.runtime.varlen_emulator``) runs the same tensors on CPU, and
``scripts/gpu_check.py``'s kernel stage compares this call with SDPA on CUDA.
The limits below are FlashAttention 2's (torch 2.13's ``flash_api.cpp``, ``mha_varlen_fwd``):
fp16/bf16 only, head_dim a multiple of 8 and at most 256, and with a block table
"Paged KV cache block size must be divisible by 256".
"""

import inspect
from typing import Any

import torch

from harness.kv_layout import KVLayout
from harness.runtime.step_tensors import StepTensors

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_BLOCK_MULTIPLE = 256
VARLEN_MAX_HEAD_DIM = 256


def varlen_signature() -> dict[str, object]:
    """What the GPU check reports of this torch's ``varlen_attn``: there or not (and why),
    and whether it takes a ``block_table``: 2.13's does; 2.11's (the H200 of 2026-12-04)
    has ``varlen_attn`` without one."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
    except ImportError as error:
        return {"available": False, "why": str(error)}
    parameters = inspect.signature(varlen_attn).parameters
    return {"available": True, "takes_block_table": "block_table" in parameters}


def varlen_takes_block_table() -> bool:
    """Whether this torch has a ``varlen_attn`` that takes a ``block_table``."""
    return varlen_signature().get("takes_block_table") is True


def varlen_limits(layout: KVLayout, block_size: int) -> list[str]:
    """What ``varlen_attn`` with a block table refuses, for this layout and block size."""
    refusals = []
    if not varlen_takes_block_table():
        refusals.append(f"torch {torch.__version__} has no varlen_attn taking a block_table")
    if layout.device.type != "cuda":
        refusals.append(f"it needs a CUDA device, the pool is on {layout.device.type}")
    if layout.dtype not in VARLEN_DTYPES:
        refusals.append(
            f"it needs float16 or bfloat16, got {str(layout.dtype).removeprefix('torch.')}"
        )
    if block_size % VARLEN_BLOCK_MULTIPLE:
        refusals.append(f"block size {block_size} is not a multiple of {VARLEN_BLOCK_MULTIPLE}")
    if layout.head_dim % 8 or layout.head_dim > VARLEN_MAX_HEAD_DIM:
        refusals.append(
            f"head_dim {layout.head_dim} is not a multiple of 8 up to {VARLEN_MAX_HEAD_DIM}"
        )
    return refusals


def varlen_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    # keys, values: each [num_blocks, block_size, num_kv_heads, head_dim]
    pages: tuple[torch.Tensor, torch.Tensor],
    step: StepTensors,
    scale: float,
    prepared: Any,  # Any: nothing is precomputed for varlen
) -> torch.Tensor:
    """One FlashAttention call for the step; ``[T, num_heads, head_dim]``."""
    # Imported here: the module exists in torch 2.13 builds, but only CUDA runs the kernel.
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415

    key_pages, value_pages = pages
    output = varlen_attn(
        query.contiguous(),  # the kernel wants the last dimension contiguous; [T, H, D]
        key_pages,
        value_pages,
        step.cu_seqlens_q,
        # NOTE: with a block table the kernel takes each request's keys from seqused_k; the
        # cumulative key counts are passed too because older builds check that cu_seq_q
        # and cu_seq_k are both given or both absent.
        step.cu_seqlens_k,
        step.max_q,
        step.max_k,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=query.shape[1] != key_pages.shape[2],
        seqused_k=step.seqused_k,
        block_table=step.block_table,
        num_splits=1,
    )
    assert isinstance(output, torch.Tensor)  # no auxiliary output was asked for
    return output
