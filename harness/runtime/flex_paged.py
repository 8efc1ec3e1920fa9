"""``--attention flex``: compiled FlexAttention over the pool in place, one call per layer.

The packed step is one FlexAttention batch of one sequence: the queries ``[1, heads, T,
head_dim]``, and as keys and values the whole pool of the layer viewed as one sequence,
``[1, kv_heads, total_blocks * block_size, head_dim]`` (a strided view, no copy). The
``BlockMask`` (query block size 1, key block size = the pool's ``block_size``) gives each
query row its own blocks from the step's ``StepTensors``: every block of its request
before the one holding its own position as *full* blocks (no mask is evaluated), and
that block as the one *partial* block, where ``mask_mod`` admits the rows up to the
query's position. Causality is bottom-right because a query's position is its request's
``seqused_k - q + i``. ``kv_indices``' last dimension is the pool's block count, as
FlexAttention requires of a mask over a key length of ``total_blocks * block_size``.

NOTE: the partial block is read whole: its rows past the query's position get a zero
weight, but ``0 * NaN`` is NaN, so a NaN-poisoned unwritten row would ruin a correct read;
``--poison-freed`` gives flex a pool poisoned with the dtype's largest finite value
(``FinitePoisonedKVPool``). NOTE: a mask with partial blocks only (no ``full_kv_*``) hit
an inductor compile error in torch 2.13, hence every block but the last passed as full,
always (zero of them included). NOTE: eager FlexAttention took 12-16 ms per call on CPU;
the compiled function is built once per process with dynamic shapes, so a new step
length ``T`` does not recompile. NOTE: CPU only (``flex_limits``): on CUDA, inductor's
FlexAttention template needs each block size divisible by its tile, and a mask of one
query per row has a query block size of 1 (torch 2.11 on an H200, 2026-12-04: "Q and KV
block size must be divisible by BLOCK_M and BLOCK_N. We got Q_BLOCK_SIZE=1").
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from harness.kv_layout import KVLayout
from harness.runtime.step_tensors import StepTensors


def flex_limits(layout: KVLayout, block_size: int) -> list[str]:
    """What ``--attention flex`` refuses: a pool on CUDA (see the module's last note)."""
    if layout.device.type == "cuda":
        return [
            "its mask has one query per row, and FlexAttention on CUDA needs a query "
            "block size divisible by its tile (16 or more); use gather"
        ]
    return []


def flex_block_mask(step: StepTensors, total_blocks: int) -> BlockMask:
    """The step's mask over a pool of ``total_blocks`` blocks: one query row per mask row."""
    device = step.block_table.device
    block_size = step.block_size
    starts = step.cu_seqlens_q.long()
    query_counts = starts[1:] - starts[:-1]  # [B]
    total_queries = int(starts[-1])
    # row_request[r]: the request of packed query row r; position[r]: its token position
    row_request = torch.repeat_interleave(
        torch.arange(step.batch_size, device=device), query_counts, output_size=total_queries
    )
    row_offset = torch.arange(total_queries, device=device) - starts[:-1][row_request]
    position = step.seqused_k.long()[row_request] - query_counts[row_request] + row_offset
    full_count = position // block_size  # [T] blocks wholly at or before the position
    rows = step.block_table.long()[row_request]  # [T, max_blocks]
    # partial_block[r], visible[r]: the block holding row r's position, and how many of its
    # rows row r sees; [row_capacity(T)], rows past T unused
    partial_block = _fixed_rows(rows.gather(1, full_count[:, None])[:, 0])
    visible = _fixed_rows(position - full_count * block_size + 1)
    full_indices = torch.zeros(total_queries, total_blocks, dtype=torch.int32, device=device)
    # Padding entries (-1) past a table become block 0: never read, full_count stops first.
    full_indices[:, : rows.shape[1]] = rows.clamp(min=0)
    partial_indices = torch.zeros_like(full_indices)
    partial_indices[:, 0] = partial_block[:total_queries]

    def mask_mod(
        batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx // block_size == partial_block[q_idx]) & (
            kv_idx % block_size < visible[q_idx]
        )

    ones = torch.ones(1, 1, total_queries, dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(
        ones,
        partial_indices[None, None],
        full_count.to(torch.int32)[None, None],
        full_indices[None, None],
        BLOCK_SIZE=(1, block_size),
        mask_mod=mask_mod,
        seq_lengths=(total_queries, total_blocks * block_size),
        compute_q_blocks=False,  # inference only: the backward's transposed indices are unused
    )


def _fixed_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` ([T] int64) as int32 in a tensor of ``row_capacity(T)`` rows.

    NOTE: what ``mask_mod`` indexes must not have a dynamic size: torch 2.13's CPU
    FlexAttention template printed the size symbol of a ``[T]`` tensor the mask indexed as
    an undeclared ``cur_kvSplitSize1`` (a C++ compile error); a size that only changes at
    powers of two past 1024 compiles as a constant.
    """
    rows = torch.zeros(row_capacity(values.shape[0]), dtype=torch.int32, device=values.device)
    rows[: values.shape[0]] = values
    return rows


def row_capacity(total_queries: int) -> int:
    """The rows of the mask's per-row tensors for a step of ``total_queries`` queries."""
    return max(1024, 1 << (total_queries - 1).bit_length())


@functools.cache
def compiled_flex_attention() -> Callable[..., Any]:
    """FlexAttention compiled once per process, with dynamic shapes (``T`` varies per step)."""
    return torch.compile(flex_attention, dynamic=True)


def flex_attention_paged(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    # keys, values: each [total_blocks, block_size, num_kv_heads, head_dim]
    pages: tuple[torch.Tensor, torch.Tensor],
    step: StepTensors,
    scale: float,
    block_mask: BlockMask,
) -> torch.Tensor:
    """The step's attention in one compiled FlexAttention call; ``[T, num_heads, head_dim]``."""
    key_pages, value_pages = pages
    num_kv_heads, head_dim = key_pages.shape[2], key_pages.shape[3]
    # [1, num_kv_heads, total_blocks * block_size, head_dim], views of the pool
    keys = key_pages.view(-1, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    values = value_pages.view(-1, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    output: torch.Tensor = compiled_flex_attention()(
        query.transpose(0, 1).unsqueeze(0),  # [1, num_heads, T, head_dim]
        keys,
        values,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=query.shape[1] != num_kv_heads,
    )
    return output[0].transpose(0, 1)
