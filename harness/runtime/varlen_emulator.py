"""A pure-PyTorch emulator of the paged varlen kernel contract (``--attention varlen-emulated``).

It computes what ``varlen_attn(..., block_table=, seqused_k=, window_size=(-1, 0),
enable_gqa=True)`` promises, from exactly the tensors that call receives
(``StepTensors``), one request at a time and in plain tensor ops, so that everything
but the CUDA call is exercised on CPU:
- it reads only keys ``t < seqused_k[b]``, each at row ``t % block_size`` of block
  ``block_table[b, t // block_size]`` (one ``index_select`` by slot: no padding entry and
  no row past ``seqused_k`` is touched, so a NaN there cannot leak in);
- causality is aligned bottom-right: query ``i`` of ``q`` sees keys ``t <= k - q + i``;
- GQA: query head ``h`` reads KV head ``h // (num_heads / num_kv_heads)``;
- scores are scaled by ``scale`` and the softmax and products run in float32.
It is a reference, not a fast path: a loop over requests, every score materialised.
"""

import torch

from harness.runtime.step_tensors import StepTensors


def varlen_attention_emulated(
    query: torch.Tensor,  # [T, num_heads, head_dim], T = cu_seqlens_q[-1]
    key_pages: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_pages: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    step: StepTensors,
    scale: float,
) -> torch.Tensor:
    """Paged causal attention of every request of the step; ``[T, num_heads, head_dim]``."""
    num_heads, num_kv_heads = query.shape[1], key_pages.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    key_rows = key_pages.flatten(0, 1)  # [num_blocks * block_size, num_kv_heads, head_dim]
    value_rows = value_pages.flatten(0, 1)
    starts = step.cu_seqlens_q.tolist()
    lengths = step.seqused_k.tolist()
    output = torch.empty_like(query)
    for b, key_count in enumerate(lengths):
        slots = key_slots(step.block_table[b], key_count, step.block_size)
        # keys, values: [num_heads, key_count, head_dim], query head h on KV head h // group
        keys = key_rows.index_select(0, slots).transpose(0, 1).repeat_interleave(group, dim=0)
        values = value_rows.index_select(0, slots).transpose(0, 1).repeat_interleave(group, dim=0)
        queries = query[starts[b] : starts[b + 1]].transpose(0, 1)  # [num_heads, q, head_dim]
        scores = (queries.float() @ keys.float().transpose(1, 2)) * scale  # [num_heads, q, k]
        allowed = causal_mask(queries.shape[1], key_count, query.device)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        output[starts[b] : starts[b + 1]] = (weights @ values.float()).transpose(0, 1)
    return output


def key_slots(block_row: torch.Tensor, key_count: int, block_size: int) -> torch.Tensor:
    """The pool rows of a request's keys ``0 .. key_count - 1`` through its table row
    (``[max_blocks]`` int32); int64 ``[key_count]``."""
    positions = torch.arange(key_count, device=block_row.device)
    blocks = block_row.long().index_select(0, positions // block_size)
    return blocks * block_size + positions % block_size


def causal_mask(query_count: int, key_count: int, device: torch.device) -> torch.Tensor:
    """``[q, k]`` bool, True = attend: query ``i`` sees keys ``<= k - q + i`` (bottom-right)."""
    allowed = torch.ones(query_count, key_count, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=key_count - query_count)
