"""What the attention hook needs from K/V memory: a ``KVStore``, and the per-step ``KVPlan``
of where each request's K/V go and come from.

Two stores implement it: the paged pool (``harness.runtime.kv_pool``) and the contiguous
buffers of the allocator gate (``harness.runtime.contiguous_kv``).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from harness.runtime.state_store import StateRows
from impl import AppendedSlots, Transfers


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One KV cache group's part of a step's plan.

    ``write_index`` holds the rows of every new token of the step in packed order.
    ``read_index`` says what a read gathers and ``read_starts`` where each request's rows
    begin in the gathered rows; they hold its positions ``first_positions[i]`` ..
    ``token_counts[i] - 1`` (a sliding window skipped the blocks before). What an index
    means is the store's.
    """

    write_index: torch.Tensor  # [step_tokens] int64
    read_index: torch.Tensor  # int64, the store's rows or blocks to gather
    read_starts: tuple[int, ...]
    first_positions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Where one forward step's K/V go and come from (shared by all layers).

    The step packs ``len(request_ids)`` requests, each feeding ``new_token_counts[i]`` new
    tokens and holding ``token_counts[i]`` after them; ``groups[g]`` is KV cache group
    ``g``'s part (one group unless the model has sliding windows); ``state_rows[i]`` is
    the row of the store's ``states`` holding request ``i``'s recurrent state (what a
    hybrid's state layers read; the paged pool's are empty without a state group).
    """

    request_ids: tuple[str, ...]
    new_token_counts: tuple[int, ...]
    token_counts: tuple[int, ...]
    groups: tuple[GroupPlan, ...]
    state_rows: tuple[int, ...] = ()

    @property
    def write_index(self) -> torch.Tensor:
        """Group 0's write rows, ``[step_tokens]`` int64."""
        return self.groups[0].write_index

    @property
    def read_index(self) -> torch.Tensor:
        """What group 0's read gathers."""
        return self.groups[0].read_index

    @property
    def read_starts(self) -> tuple[int, ...]:
        """Where each request's rows begin in group 0's gathered rows."""
        return self.groups[0].read_starts


class KVStore(Protocol):
    """What the attention hook needs from K/V memory: plan once per step, write, read.

    ``plan`` takes what the manager's ``allocate`` or ``append`` gave each request of the
    step (``AppendedSlots``: every KV cache group's table after this step's tokens and
    those tokens' slots), whole. The engine also tells it about the lifecycle: ``transfer``
    (the manager's ``take_transfers``: copies between the tiers and copy-on-write copies
    in their order, then the blocks sliding windows made free), ``release`` (with the
    blocks that became free and hold no cached prefix: a shared or cached block keeps
    valid K/V), ``fork``, the rollback ``truncate`` and the host tier's ``swap_out``.
    A hybrid's recurrent states are in ``states``, at the plan's ``state_rows``.
    """

    states: StateRows

    def plan(self, steps: Sequence[AppendedSlots]) -> KVPlan:
        """The step's plan, built once and used by every layer."""
        ...

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new ``key``/``value`` rows ``[step_tokens, num_kv_heads, head_dim]``."""
        ...

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's K and V in SDPA's layout, ``[1, num_kv_heads, tokens, head_dim]``
        (strided views are fine), in plan order: its positions ``first_positions`` on."""
        ...

    def first_positions(self, layer_idx: int, plan: KVPlan) -> tuple[int, ...]:
        """The position of the first row ``read`` returns for each request in this layer."""
        ...

    def release(self, request_id: str, block_ids: list[int]) -> None: ...

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """A request was rolled back (rejected drafts): ``block_ids`` became free and
        uncached, and its kept last block's ``slots`` past the new length will be written
        again; nobody may read either."""
        ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def transfer(self, transfers: Transfers) -> None:
        """What the manager's ``take_transfers`` handed over, in its order: every copy
        ``(device, host)`` out, every copy-on-write ``(source, destination)``, every
        ``(host, device)`` copy in; then the skipped blocks, which nobody may read again."""
        ...

    def swap_out(self, request_id: str, block_ids: list[int]) -> None:
        """A request was swapped out (it keeps its K/V in the host tier) and its copies out
        are made: ``block_ids`` became free and hold no cached prefix."""
        ...


def sdpa_layout(rows: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` rows as a ``[1, num_kv_heads, tokens, head_dim]`` view.

    NOTE: a strided view, not a copy: SDPA gives the same bits on it as on HF's contiguous
    cache (check 2 measures it), and a ``.contiguous()`` cost two copies per request per
    layer.
    """
    return rows.flatten(0, -3).transpose(0, 1).unsqueeze(0)
