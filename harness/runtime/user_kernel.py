"""Your own paged-attention kernel as an attention backend: its contract, and the checks of
what it returns.

``check_model(..., attention=my_kernel)`` and ``python -m harness --attention
package.module:function`` run the three checks with ``my_kernel`` computing every paged
step's attention, exactly where ``--attention triton`` or ``varlen`` would. The contract,
one call per layer per step, for every request of the step at once::

    my_kernel(query, key_pages, value_pages, step, scale) -> output

    query        [T, num_heads, head_dim]: the step's queries, request b's at rows
                 step.cu_seqlens_q[b] .. step.cu_seqlens_q[b + 1] (prefill chunks and
                 decodes mixed), in the model's dtype, on the pool's device
    key_pages,
    value_pages  [num_blocks, block_size, num_kv_heads, head_dim]: one layer of the pool,
                 read in place; this step's K/V already written
    step         harness.runtime.step_tensors.StepTensors: block_table [B, max_blocks]
                 int32 (-1 past a request's blocks), seqused_k [B] int32 (request b's keys:
                 every token it holds), cu_seqlens_q [B + 1] int32, max_q, max_k,
                 block_size; key t of request b is row t % block_size of block
                 block_table[b, t // block_size]
    scale        the softmax scale (the model's, else 1 / sqrt(head_dim))
    output       [T, num_heads, head_dim], query's dtype and device

Attention is causal, bottom-right: query ``i`` of a request's ``q`` queries over ``k`` keys
sees keys ``t <= k - q + i``; query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``. The kernel may assume what ``StepTensors`` promises, and nothing of the
blocks it is not pointed to: with ``poison_freed`` those hold NaN (freed blocks, rows past
``seqused_k``), so a kernel that reads one returns NaN, which is refused here in one line
naming the request. A return of the wrong type, shape, dtype or device is refused the same
way (``UserKernelError``), before it reaches the model. Each call is checked, so the NaN
check costs a device sync per layer: this is a checking harness.
"""

from collections.abc import Callable

import torch

from harness.runtime.attention_backends import (
    AttentionBackendError,
    PagedKernel,
    no_limits,
    nothing_precomputed,
)
from harness.runtime.step_tensors import StepTensors

# kernel(query, key_pages, value_pages, step, scale) -> output (the contract above)
UserKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepTensors, float], object]


class UserKernelError(AttentionBackendError):
    """A user's kernel broke its contract (wrong return, NaN read): one line saying how."""


def kernel_name(kernel: UserKernel) -> str:
    """``module:function`` of ``kernel``, as the report names the backend."""
    module = getattr(kernel, "__module__", None) or "?"
    return f"{module}:{getattr(kernel, '__qualname__', type(kernel).__name__)}"


def checked_output(name: str, output: object, query: torch.Tensor, step: StepTensors) -> None:
    """Refuse, in one line, an output that breaks the contract for ``query``."""
    if not isinstance(output, torch.Tensor):
        raise UserKernelError(
            f"attention kernel {name} returned {type(output).__name__}, not a tensor"
        )
    wanted = f"[{', '.join(map(str, query.shape))}] ([T, num_heads, head_dim], as the query)"
    if output.shape != query.shape:
        raise UserKernelError(
            f"attention kernel {name} returned shape [{', '.join(map(str, output.shape))}], "
            f"not {wanted}"
        )
    if output.dtype != query.dtype:
        raise UserKernelError(
            f"attention kernel {name} returned {str(output.dtype).removeprefix('torch.')}, "
            f"not the query's {str(query.dtype).removeprefix('torch.')}"
        )
    if output.device != query.device:
        raise UserKernelError(
            f"attention kernel {name} returned a tensor on {output.device}, "
            f"not on the query's {query.device}"
        )
    bad_rows = output.isnan().flatten(1).any(dim=1).nonzero().flatten()
    if bad_rows.numel():
        row = int(bad_rows[0])
        request = int(torch.searchsorted(step.cu_seqlens_q, row, right=True)) - 1
        raise UserKernelError(
            f"attention kernel {name} returned NaN in {bad_rows.numel()} query rows, first "
            f"row {row} (request {request} of the step): it read a row it must not (a freed "
            "block, a row at or past seqused_k, a padding entry of block_table)"
        )


def user_kernel_backend(kernel: UserKernel) -> PagedKernel:
    """``kernel`` behind the backend seam, every output checked (``checked_output``)."""
    name = kernel_name(kernel)

    def attend(
        query: torch.Tensor,
        pages: tuple[torch.Tensor, torch.Tensor],
        step: StepTensors,
        scale: float,
        prepared: object,
    ) -> torch.Tensor:
        output = kernel(query, pages[0], pages[1], step, scale)
        checked_output(name, output, query, step)
        assert isinstance(output, torch.Tensor)  # checked_output refused anything else
        return output

    return PagedKernel(name, attend, no_limits, nothing_precomputed)
