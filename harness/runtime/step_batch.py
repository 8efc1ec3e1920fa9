"""One forward's batch: the requests it packs as the model's inputs, and what attention
needs to serve each of them (``StepMetadata``, travelling to every layer).

``pack_step`` lays the requests out as ``input_ids [1, T]`` with explicit positions, each
request's query rows a ``RequestSlice`` (with the partial-prefill mask it needs), and the
rows whose logits the step keeps. It reads the engine's records; it calls no manager.
"""

from dataclasses import dataclass

import torch

from harness.runtime.attention_backends import KernelStep
from harness.runtime.kv_store import KVPlan, KVStore
from harness.runtime.requests import RunningRequest
from spec import RequestBlockTable


@dataclass(frozen=True, slots=True)
class RequestSlice:
    """One request's part of a packed step: its query rows ``[query_start, query_end)``.

    ``mask`` is the partial-prefill mask (``partial_prefill_mask``), ``None`` otherwise.
    """

    query_start: int
    query_end: int
    mask: torch.Tensor | None = None  # [1, 1, query_count, token_count] bool, True = attend


def partial_prefill_mask(
    query_count: int, token_count: int, device: torch.device
) -> torch.Tensor | None:
    """The causal mask for the last ``query_count`` of ``token_count`` tokens, or ``None``.

    ``None`` when no mask is needed: a whole prefill (SDPA's ``is_causal``) or one query.
    """
    if query_count <= 1 or query_count == token_count:
        return None
    # allowed[i, j]: query i sits at position token_count - query_count + i and sees key j <= it
    allowed = torch.ones(query_count, token_count, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=token_count - query_count)[None, None]


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything attention needs for one forward: the store, its plan, each request's slice.

    ``slices[i]`` is the request ``plan.request_ids[i]``; ``kernel``: the kernel backend's
    call for the step, ``None`` for gather.
    """

    store: KVStore
    plan: KVPlan
    slices: tuple[RequestSlice, ...]
    kernel: KernelStep | None = None


@dataclass(frozen=True, slots=True)
class PackedStep:
    """The model's inputs for one forward of several requests, packed in order."""

    input_ids: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [1, T] int64
    slices: tuple[RequestSlice, ...]
    logit_rows: torch.Tensor  # [rows] int64: the positions in T whose logits are kept


def pack_step(
    group: list[RunningRequest], tables: list[RequestBlockTable], device: torch.device
) -> PackedStep:
    """Pack each request's ``pending_ids`` (its table ``tables[i]`` already holds them):
    its ``logit_rows`` are its last query rows (a decode's one per fed token, a prefill's
    last chunk one, an earlier chunk none)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slices: list[RequestSlice] = []
    for running, table in zip(group, tables, strict=True):
        start = len(input_ids)
        input_ids.extend(running.pending_ids)
        new_tokens = len(running.pending_ids)
        positions.extend(range(table.token_count - new_tokens, table.token_count))
        mask = partial_prefill_mask(new_tokens, table.token_count, device)
        slices.append(RequestSlice(start, len(input_ids), mask))
    rows = [
        row
        for running, part in zip(group, slices, strict=True)
        for row in range(part.query_end - running.logit_rows, part.query_end)
    ]
    return PackedStep(
        torch.tensor([input_ids], dtype=torch.int64, device=device),
        torch.tensor([positions], dtype=torch.int64, device=device),
        tuple(slices),
        torch.tensor(rows, dtype=torch.int64, device=device),
    )
