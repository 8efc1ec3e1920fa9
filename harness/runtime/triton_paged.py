"""``--attention triton``: the project's own paged-attention kernel, written in Triton.

One launch per layer per step computes every request of the step, prefill chunks and
decode tokens together, reading K and V rows through the block table in place (no gather,
no copy). Written from the algorithm: FlashAttention-2's online softmax (Dao, 2023:
running row maxima and sums, the output rescaled as each key tile arrives) over the
PagedAttention paper's block table (Kwon et al., 2023: key ``t`` of a request at row
``t % block_size`` of block ``block_table[b, t // block_size]``).

A program computes one tile of ``BLOCK_Q`` queries of one request for every query head of
one KV head (GQA: query head ``h`` reads KV head ``h // group``), so its
``BLOCK_Q * GROUP_P`` rows share each key tile they load. It walks the request's keys from
position 0 in tiles of ``BLOCK_N`` in logical order, up to the last key its last query may
see (causality is bottom-right: query ``i`` of ``q`` sits at position ``k - q + i`` and
sees keys ``<= k - q + i``). Scores, maxima, sums and the output accumulate in float32;
the probabilities meet V in V's dtype (float32 stays float32, ``ieee`` precision).

Deterministic by construction: a request's tiles depend on the request alone (``BLOCK_Q``
and ``BLOCK_N`` are fixed per layout, never per batch), keys arrive in one order, there is
no split over keys and no atomic, so a request's output depends neither on its batch
neighbours nor on where its blocks lie: over the contiguous store it gives the same bits,
which keeps the allocator gate bitwise. No key at or past ``seqused_k`` and no padding
entry of the table is loaded, so the pool's NaN poison is never read.

On CUDA the kernel is compiled by Triton. On CPU tensors it runs in Triton's interpreter,
which is how CI checks it without a GPU; a process is in one mode or the other, fixed when
it first imports triton (``TRITON_INTERPRET=1`` in the environment then: the interpreter),
so ``triton_limits`` refuses a pool on the other side, and in the interpreter any dtype
but float32 (its ``tl.dot`` on bfloat16 is wrong, triton#11584).
"""

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from harness.kv_layout import KVLayout
from harness.runtime.step_tensors import StepTensors

# Keys per tile. NOTE: 16 is tl.dot's smallest side on NVIDIA GPUs; 32 halves the loop
# trips of a long context at the price of more masked lanes in a short one.
BLOCK_N = 32
# Rows per program (queries x padded query heads of one KV head): tl.dot needs 16 or more.
MIN_ROWS = 16


# A kernel's arguments are its launch ABI (pointers, strides, then compile-time constants,
# upper case as Triton writes them): positional, and many. ``triton.jit`` compiles it below.
def _paged_attention(  # noqa: PLR0917
    # Inside a kernel every argument is a tl.tensor: the pointers, and the scalars as 0-d
    # tensors. (Not ``Any``: Triton's compiler resolves annotations as kernel globals.)
    out_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    block_table_ptr: tl.tensor,
    seqused_k_ptr: tl.tensor,
    cu_seqlens_q_ptr: tl.tensor,
    scale: tl.tensor,
    q_tiles: tl.tensor,
    q_stride_t: tl.tensor,
    q_stride_h: tl.tensor,
    o_stride_t: tl.tensor,
    o_stride_h: tl.tensor,
    k_stride_block: tl.tensor,
    k_stride_row: tl.tensor,
    k_stride_head: tl.tensor,
    v_stride_block: tl.tensor,
    v_stride_row: tl.tensor,
    v_stride_head: tl.tensor,
    table_stride: tl.tensor,
    GROUP: tl.constexpr,  # noqa: N803
    GROUP_P: tl.constexpr,  # noqa: N803
    HEAD_DIM: tl.constexpr,  # noqa: N803
    HEAD_DIM_P: tl.constexpr,  # noqa: N803
    BLOCK_SIZE: tl.constexpr,  # noqa: N803
    BLOCK_Q: tl.constexpr,  # noqa: N803
    BLOCK_N: tl.constexpr,  # noqa: N803
    PRECISION: tl.constexpr,  # noqa: N803
) -> None:
    """One program: query tile ``program_id(0) % q_tiles`` of request ``program_id(0) //
    q_tiles``, every query head of KV head ``program_id(1)``."""
    request = tl.program_id(0) // q_tiles
    tile = tl.program_id(0) % q_tiles
    kv_head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + request)
    q_count = tl.load(cu_seqlens_q_ptr + request + 1) - q_start
    if tile * BLOCK_Q < q_count:
        kv_count = tl.load(seqused_k_ptr + request)
        rows = tl.arange(0, BLOCK_Q * GROUP_P)
        query = tile * BLOCK_Q + rows // GROUP_P  # the row's query, within the request
        head = kv_head * GROUP + rows % GROUP_P
        row_ok = (query < q_count) & (rows % GROUP_P < GROUP)
        position = kv_count - q_count + query  # the row's query position: it sees keys <= it
        dims = tl.arange(0, HEAD_DIM_P)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr
            + (q_start + query)[:, None] * q_stride_t
            + head[:, None] * q_stride_h
            + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        row_max = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
        # The keys the tile's last query sees: no row needs a key past it.
        key_end = kv_count - q_count + tl.minimum(q_count, (tile + 1) * BLOCK_Q)
        for key_start in range(0, key_end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_ok = keys < key_end
            block = tl.load(
                block_table_ptr + request * table_stride + keys // BLOCK_SIZE,
                mask=key_ok,
                other=0,
            ).to(tl.int64)
            slot_row = keys % BLOCK_SIZE
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_ptr
                + block[:, None] * k_stride_block
                + slot_row[:, None] * k_stride_row
                + kv_head * k_stride_head
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row that has seen no key yet (a padding row) keeps -inf: shift by 0 there,
            # so exp gives 0 rather than exp(-inf - -inf) = NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probabilities = tl.exp(scores - shift[:, None])
            rescale = tl.exp(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(probabilities, 1)
            v = tl.load(
                v_ptr
                + block[:, None] * v_stride_block
                + slot_row[:, None] * v_stride_row
                + kv_head * v_stride_head
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = acc * rescale[:, None] + tl.dot(
                probabilities.to(v.dtype), v, input_precision=PRECISION
            )
            row_max = new_max
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + (q_start + query)[:, None] * o_stride_t
            + head[:, None] * o_stride_h
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


# Any: a Triton JITFunction (or, in the interpreter, an InterpretedFunction); triton is untyped.
paged_attention_kernel: Any = triton.jit(_paged_attention)


def interpreted() -> bool:
    """Whether this process runs Triton's interpreter (decided at its import of triton)."""
    return isinstance(tl.zeros, InterpretedFunction)


def triton_limits(layout: KVLayout, block_size: int) -> list[str]:
    """What this kernel cannot run in this process: a pool on the other side of Triton's
    mode, or a dtype other than float32 in the interpreter."""
    if layout.device.type == "cpu" and not interpreted():
        return [
            "on CPU it runs in Triton's interpreter, which this process did not start "
            "(set TRITON_INTERPRET=1 before starting it)"
        ]
    if layout.device.type != "cpu" and interpreted():
        return [
            f"TRITON_INTERPRET=1 runs Triton's interpreter, which cannot read a "
            f"{layout.device.type} pool"
        ]
    if interpreted() and layout.dtype != torch.float32:
        dtype = str(layout.dtype).removeprefix("torch.")
        return [f"Triton's interpreter computes float32 only (triton#11584), got {dtype}"]
    return []


def triton_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    # keys, values: each [num_blocks, block_size, num_kv_heads, head_dim]
    pages: tuple[torch.Tensor, torch.Tensor],
    step: StepTensors,
    scale: float,
    prepared: Any,  # Any: nothing is precomputed for this kernel
    *,
    kernel: Any = paged_attention_kernel,  # Any: a Triton function
) -> torch.Tensor:
    """The step's causal paged attention in one launch; ``[T, num_heads, head_dim]``.

    ``kernel`` is the Triton function launched: the tests pass planted-bug copies of it.
    """
    key_pages, value_pages = pages
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_pages.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    block_q = max(1, MIN_ROWS // group_padded)
    # The kernel reads head_dim at stride 1 and the rest through strides: the hook's query,
    # a transposed view, is read in place (no copy a layer).
    if query.stride(2) != 1:
        query = query.contiguous()
    if key_pages.stride(3) != 1 or value_pages.stride(3) != 1:
        raise ValueError("the pages' head_dim must be contiguous (stride 1)")
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    q_tiles = triton.cdiv(step.max_q, block_q)
    grid = (step.batch_size * q_tiles, num_kv_heads)
    kernel[grid](
        output,
        query,
        key_pages,
        value_pages,
        step.block_table,
        step.seqused_k,
        step.cu_seqlens_q,
        scale,
        q_tiles,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_pages.stride(0),
        key_pages.stride(1),
        key_pages.stride(2),
        value_pages.stride(0),
        value_pages.stride(1),
        value_pages.stride(2),
        step.block_table.stride(0),
        GROUP=group,
        GROUP_P=group_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=step.block_size,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        # float32: full precision (Triton's default on NVIDIA is TF32, which would make the
        # kernel disagree with gather by ~1e-3); other dtypes take Triton's default.
        PRECISION="ieee" if query.dtype == torch.float32 else None,
    )
    return output
