"""The allocator gate's paging-free store: each request's K/V in its own buffer, by position.

No block id from the manager is used here, so running the same engine on these buffers
and on the paged pool, and demanding bit-identical logits, tests the allocator's tables.
"""

from collections.abc import Sequence

import torch

from harness.kv_layout import KVLayout
from harness.runtime.kv_store import GroupPlan, KVPlan, sdpa_layout
from harness.runtime.state_store import StateRows, grown_rows
from impl import AppendedSlots, Transfers
from spec import RequestBlockTable, blocks_for_tokens


class ContiguousKVBuffers:
    """Each request's K/V in its own buffer, by position: the gate's paging-free twin.

    Request ``r`` owns one row of a per-layer ``[rows, row_tokens, num_kv_heads, head_dim]``
    tensor (``row_tokens``: ``max_tokens`` rounded up to ``block_size``); token ``t`` lives
    at position ``t`` of its row. No block id from the manager is used. A kernel backend
    reads the same memory as pages (``pages``): the row of ``r`` is the run of pages
    ``block_ids_of(r)``, in order, so the kernel reads contiguous buffers through a table
    that is an ``arange``.
    """

    __slots__ = (
        "_free_rows",
        "_keys",
        "_rows",
        "_values",
        "block_size",
        "layout",
        "row_tokens",
        "states",
    )

    def __init__(self, layout: KVLayout, max_tokens: int, block_size: int = 1) -> None:
        if max_tokens < 1 or block_size < 1:
            raise ValueError(
                f"max_tokens and block_size must be >= 1, got {max_tokens}, {block_size}"
            )
        self.layout = layout
        self.block_size = block_size
        self.row_tokens = blocks_for_tokens(block_size, max_tokens) * block_size
        shape = (0, self.row_tokens, layout.num_kv_heads, layout.head_dim)
        # _keys[l], _values[l]: [rows, row_tokens, num_kv_heads, head_dim]
        self._keys = [
            torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for _ in range(layout.num_layers)
        ]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._rows: dict[str, int] = {}  # request_id -> its row
        self._free_rows: list[int] = []
        # A hybrid's recurrent states: the request's row of them, as its K/V's
        self.states = StateRows(layout, 0)

    def plan(self, steps: Sequence[AppendedSlots]) -> KVPlan:
        """Rows are positions in each request's own buffer; block tables are not used (nor
        windows: every position is kept)."""
        device = self.layout.device
        rows: list[int] = []
        for step in steps:
            if step.request_id not in self._rows:
                self._rows[step.request_id] = self._take_row()
            base = self._rows[step.request_id] * self.row_tokens
            new_tokens = len(step.slots[0])
            rows.extend(range(base + step.token_count - new_tokens, base + step.token_count))
        everything = GroupPlan(
            write_index=torch.tensor(rows, dtype=torch.int64, device=device),
            read_index=torch.empty(0, dtype=torch.int64, device=device),
            read_starts=(0,) * len(steps),
            first_positions=(0,) * len(steps),
        )
        return KVPlan(
            request_ids=tuple(step.request_id for step in steps),
            new_token_counts=tuple(len(step.slots[0]) for step in steps),
            token_counts=tuple(step.token_count for step in steps),
            groups=(everything,),
            state_rows=tuple(self._rows[step.request_id] for step in steps),
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store each request's new tokens at their positions in its own buffer."""
        flat = (-1, self.layout.num_kv_heads, self.layout.head_dim)
        self._keys[layer_idx].view(flat).index_copy_(0, plan.write_index, key)
        self._values[layer_idx].view(flat).index_copy_(0, plan.write_index, value)

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``token_count`` rows of each request's buffer, in SDPA's layout."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        read = []
        for request_id, count in zip(plan.request_ids, plan.token_counts, strict=True):
            row = self._rows[request_id]
            read.append((sdpa_layout(keys[row, :count]), sdpa_layout(values[row, :count])))
        return read

    def pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s buffers as pages ``[pages, block_size, num_kv_heads, head_dim]``
        (views, no copy)."""
        shape = (-1, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        return self._keys[layer_idx].view(shape), self._values[layer_idx].view(shape)

    def block_ids_of(self, table: RequestBlockTable) -> list[int]:
        """The pages of ``table``'s request that hold its ``token_count`` tokens, in order."""
        first = self._rows[table.request_id] * blocks_for_tokens(self.block_size, self.row_tokens)
        return list(range(first, first + blocks_for_tokens(self.block_size, table.token_count)))

    def first_positions(self, layer_idx: int, plan: KVPlan) -> tuple[int, ...]:
        """Every request's buffer starts at position 0."""
        return plan.groups[0].first_positions

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """Give back a finished request's row (its block ids mean nothing here)."""
        self._free_rows.append(self._rows.pop(request_id))

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """Nothing to do: rows past a request's length are never read, and are rewritten."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with a copy of the parent's buffers: nothing is shared here."""
        parent, child = self._rows[parent_id], self._take_row()
        self._rows[child_id] = child
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[child] = keys[parent]
            values[child] = values[parent]
        self.states.copy([(parent, child)])

    def transfer(self, transfers: Transfers) -> None:
        """Nothing to copy or drop: no two requests share a buffer, a swapped-out request
        keeps its buffer here, and buffers keep every position."""

    def swap_out(self, request_id: str, block_ids: list[int]) -> None:
        """Keep the request's row: it resumes from it when swapped back in, so the gate
        compares the pool's round trip through the host tier with K/V that never moved."""

    def _take_row(self) -> int:
        """A zeroed row for a new request: a freed one, else one more (the tensors grow).

        NOTE: growing doubles the rows, copying every layer (a handful of times per run);
        a zeroed row keeps what a fresh per-request buffer had.
        """
        if not self._free_rows:
            rows = self._keys[0].shape[0]
            grown = max(1, 2 * rows)
            self._keys = [grown_rows(keys, grown) for keys in self._keys]
            self._values = [grown_rows(values, grown) for values in self._values]
            self.states.grow(grown)
            self._free_rows.extend(range(grown - 1, rows - 1, -1))
        row = self._free_rows.pop()
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[row].zero_()
            values[row].zero_()
        return row
