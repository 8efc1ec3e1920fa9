"""Paged-attention kernels a user might hand to ``check_model(..., attention=...)`` or
``--attention tests.support.user_kernels:NAME``: one that keeps the contract
(``harness.runtime.user_kernel``), and one for each way of breaking it."""

from collections.abc import Callable

import torch

from harness.runtime.step_tensors import StepTensors
from harness.runtime.user_kernel import UserKernel
from harness.runtime.varlen_emulator import causal_mask, key_slots, varlen_attention_emulated


def emulated(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    step: StepTensors,
    scale: float,
) -> torch.Tensor:
    """A correct kernel: the varlen contract in plain PyTorch."""
    return varlen_attention_emulated(query, key_pages, value_pages, step, scale)


def no_causal_mask(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    step: StepTensors,
    scale: float,
) -> torch.Tensor:
    """Wrong numbers: a prefill's queries see the whole prompt, later tokens included."""
    output = torch.empty_like(query)
    starts = step.cu_seqlens_q.tolist()
    for b, key_count in enumerate(step.seqused_k.tolist()):
        slots = key_slots(step.block_table[b], key_count, step.block_size)
        group = query.shape[1] // key_pages.shape[2]
        keys = key_pages.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(group, dim=0)
        values = value_pages.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(group, dim=0)
        queries = query[starts[b] : starts[b + 1]].transpose(0, 1)
        scores = (queries @ keys.transpose(1, 2)) * scale
        assert causal_mask(queries.shape[1], key_count, query.device).shape == scores.shape[1:]
        output[starts[b] : starts[b + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
    return output


def _after_emulated(change: Callable[[torch.Tensor, StepTensors], object]) -> UserKernel:
    """A kernel that computes what ``emulated`` does, then breaks it as ``change`` does
    (named after ``change``, as the report names it)."""

    def kernel(
        query: torch.Tensor,
        key_pages: torch.Tensor,
        value_pages: torch.Tensor,
        step: StepTensors,
        scale: float,
    ) -> object:
        return change(emulated(query, key_pages, value_pages, step, scale), step)

    kernel.__name__ = kernel.__qualname__ = change.__name__
    kernel.__doc__ = change.__doc__
    return kernel


@_after_emulated
def wrong_shape(output: torch.Tensor, step: StepTensors) -> torch.Tensor:
    """Returns one head too few."""
    return output[:, 1:]


@_after_emulated
def wrong_dtype(output: torch.Tensor, step: StepTensors) -> torch.Tensor:
    """Returns float64."""
    return output.double()


@_after_emulated
def not_a_tensor(output: torch.Tensor, step: StepTensors) -> list[float]:
    """Returns a list."""
    return output.flatten().tolist()


@_after_emulated
def nan_in_the_last_request(output: torch.Tensor, step: StepTensors) -> torch.Tensor:
    """As a kernel that read a poisoned row would: NaN in the last request's first row."""
    output[int(step.cu_seqlens_q[-2])] = float("nan")
    return output
