"""Where K/V tensors live: the paged pool, and the contiguous buffers the allocator gate uses.

``PagedKVPool`` is the real thing: per layer one K and one V tensor of shape
``[total_blocks, block_size, num_kv_heads, head_dim]`` (with sliding windows, per layer of
a KV cache group, shared by the groups: ``harness.kv_layout.kv_cache_groups``). Token ``t``
of a request lives in row ``spec.slot_index(block_size, block_ids, t, skipped_blocks)`` of
the flat view ``[total_blocks * block_size, num_kv_heads, head_dim]``, through the table
of its layer's group; the slots come from ``impl.KVBlockManager`` and nothing else.
Layout, block-major then token then head:
- a block is one contiguous chunk of memory, so releasing or poisoning a block is one
  slice write, and a request's K/V for one block is one contiguous read;
- the flat view is a free reshape, so writing a step's new tokens is one ``index_copy_``
  by slot, and reading every request of a step is one ``index_select`` by block;
- ``[num_kv_heads, head_dim]`` last matches the ``[tokens, heads, dim]`` rows the model's
  projections produce, so a write needs no transpose.

``ContiguousKVBuffers`` keeps each request's K/V in its own ``[max_tokens, ...]`` buffer,
indexed by position: no block ids at all. The allocator gate runs the same engine on both
and demands bit-identical logits.

Neither decides *when* a request gets memory: that is the engine's job (with the manager).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from harness.kv_layout import KVLayout
from impl import KVBlockManager, RequestBlockTable


def new_manager(layout: KVLayout, total_blocks: int, block_size: int) -> KVBlockManager:
    """A manager for a pool of ``layout``: one KV cache group per group of its layers."""
    return KVBlockManager(total_blocks, block_size, group_windows=layout.group_windows)


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
    ``g``'s part (one group unless the model has sliding windows).
    """

    request_ids: tuple[str, ...]
    new_token_counts: tuple[int, ...]
    token_counts: tuple[int, ...]
    groups: tuple[GroupPlan, ...]

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

    ``plan`` takes each request's table after this step's tokens and the slots of those
    tokens (KV cache group 0), and with several groups each request's table in groups
    1.. (``group_tables[g - 1][i]``). The engine also tells it about the lifecycle:
    ``release`` (with the blocks that became free and hold no cached prefix: a shared or
    cached block keeps valid K/V), ``release_out_of_window`` (blocks a sliding window made
    free, likewise), ``fork``, the copy-on-write ``copy_blocks`` and the rollback
    ``truncate``.
    """

    def plan(
        self,
        tables: Sequence[RequestBlockTable],
        new_slots: Sequence[list[int]],
        group_tables: Sequence[Sequence[RequestBlockTable]] = (),
    ) -> KVPlan:
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

    def release_out_of_window(self, block_ids: list[int]) -> None: ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


class PagedKVPool:
    """The paged KV pool: ``total_blocks`` blocks of ``block_size`` tokens for every layer.

    With KV cache groups (sliding windows), block ``b`` holds the K/V of the layers of
    whichever group's table holds it: tensor ``keys[i]`` is shared by the ``i``-th layer of
    every group (vLLM's layout), so a block costs one group's layers, not every layer's.
    """

    __slots__ = (
        "_flat_keys",
        "_flat_values",
        "_places",
        "block_size",
        "keys",
        "layout",
        "total_blocks",
        "values",
    )

    def __init__(self, layout: KVLayout, total_blocks: int, block_size: int) -> None:
        if total_blocks < 1 or block_size < 1:
            raise ValueError(
                f"total_blocks and block_size must be >= 1, got {total_blocks}, {block_size}"
            )
        self.layout = layout
        self.total_blocks = total_blocks
        self.block_size = block_size
        shape = (total_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        # keys[i], values[i]: [total_blocks, block_size, num_kv_heads, head_dim], the i-th
        # layer of each group (with one group: layer i)
        self.keys = [
            torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for _ in range(layout.layers_per_block)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        flat = (total_blocks * block_size, layout.num_kv_heads, layout.head_dim)
        # Views sharing the storage above: [total_blocks * block_size, num_kv_heads, head_dim]
        self._flat_keys = [k.view(flat) for k in self.keys]
        self._flat_values = [v.view(flat) for v in self.values]
        # _places[layer_idx]: (its group, its tensor index)
        places = {
            layer_idx: (group, index)
            for group, layers in enumerate(layout.group_layers)
            for index, layer_idx in enumerate(layers)
        }
        self._places = tuple(places[layer_idx] for layer_idx in range(layout.num_layers))

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds for K and V over all layers."""
        return self.total_blocks * self.block_size * self.layout.bytes_per_block_token

    def plan(
        self,
        tables: Sequence[RequestBlockTable],
        new_slots: Sequence[list[int]],
        group_tables: Sequence[Sequence[RequestBlockTable]] = (),
    ) -> KVPlan:
        """Writes go to the pool slots ``new_slots`` (group 0; the others' from their
        tables); a read gathers each group's held blocks whole.

        NOTE: reading by block, not by slot, moves ``block_size`` rows per index (one
        memcpy-sized chunk) and one ``index_select`` serves every request of the step; it
        copies at most ``block_size - 1`` unused rows per request, which no one reads.
        """
        groups = len(self.layout.group_layers)
        if 1 + len(group_tables) != groups:
            raise ValueError(
                f"the pool has {groups} KV cache groups, the plan {1 + len(group_tables)}"
            )
        new_token_counts = tuple(len(slots) for slots in new_slots)
        group_plans = [self._group_plan(tables, [s for slots in new_slots for s in slots])]
        for more in group_tables:
            group_plans.append(self._group_plan(more, self._new_slots(more, new_token_counts)))
        return KVPlan(
            request_ids=tuple(table.request_id for table in tables),
            new_token_counts=new_token_counts,
            token_counts=tuple(table.token_count for table in tables),
            groups=tuple(group_plans),
        )

    def _new_slots(
        self, tables: Sequence[RequestBlockTable], new_token_counts: tuple[int, ...]
    ) -> list[int]:
        """The slots of each request's last ``new_token_counts[i]`` tokens in its table."""
        block_size = self.block_size
        return [
            table.block_ids[position // block_size - table.skipped_blocks] * block_size
            + position % block_size
            for table, count in zip(tables, new_token_counts, strict=True)
            for position in range(table.token_count - count, table.token_count)
        ]

    def _group_plan(self, tables: Sequence[RequestBlockTable], slots: list[int]) -> GroupPlan:
        device = self.layout.device
        block_counts = [len(table.block_ids) for table in tables]
        return GroupPlan(
            write_index=torch.tensor(slots, dtype=torch.int64, device=device),
            read_index=torch.tensor(
                [block_id for table in tables for block_id in table.block_ids],
                dtype=torch.int64,
                device=device,
            ),
            read_starts=tuple(
                self.block_size * start for start in accumulate(block_counts, initial=0)
            )[:-1],
            first_positions=tuple(self.block_size * table.skipped_blocks for table in tables),
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new ``key``/``value`` ``[step_tokens, num_kv_heads, head_dim]``."""
        group, index = self._places[layer_idx]
        write_index = plan.groups[group].write_index
        self._flat_keys[index].index_copy_(0, write_index, key)
        self._flat_values[index].index_copy_(0, write_index, value)

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's K and V from its group's first held block, ``[1, num_kv_heads,
        token_count - first_position, head_dim]``: views of one gather."""
        group, index = self._places[layer_idx]
        group_plan = plan.groups[group]
        keys = _sdpa_layout(self.keys[index].index_select(0, group_plan.read_index))
        values = _sdpa_layout(self.values[index].index_select(0, group_plan.read_index))
        return [
            (keys[:, :, start : start + count - first], values[:, :, start : start + count - first])
            for start, count, first in zip(
                group_plan.read_starts, plan.token_counts, group_plan.first_positions, strict=True
            )
        ]

    def pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V tensors, ``[total_blocks, block_size, num_kv_heads,
        head_dim]``: what a kernel backend reads in place."""
        index = self._places[layer_idx][1]
        return self.keys[index], self.values[index]

    def block_ids_of(self, table: RequestBlockTable) -> list[int]:
        """The pool blocks of ``table``: its own block ids (the manager's)."""
        return list(table.block_ids)

    def first_positions(self, layer_idx: int, plan: KVPlan) -> tuple[int, ...]:
        """Where each request's rows start: its group's skipped blocks' tokens."""
        return plan.groups[self._places[layer_idx][0]].first_positions

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """A request let go of ``block_ids``; their rows keep stale K/V until overwritten."""

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """A request was rolled back; the rows keep stale K/V until overwritten."""

    def release_out_of_window(self, block_ids: list[int]) -> None:
        """Sliding windows let go of ``block_ids``; their rows keep stale K/V."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """Nothing to do: the child's table names the parent's blocks."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's K and V rows of each ``source`` block to ``destination``.

        In order, so a destination of one pair could be a later pair's source.
        """
        device = self.layout.device
        for source, destination in copies:
            source_index = torch.tensor([source], dtype=torch.int64, device=device)
            destination_index = torch.tensor([destination], dtype=torch.int64, device=device)
            for keys, values in zip(self.keys, self.values, strict=True):
                # keys.index_select(...): [1, block_size, num_kv_heads, head_dim]
                keys.index_copy_(0, destination_index, keys.index_select(0, source_index))
                values.index_copy_(0, destination_index, values.index_select(0, source_index))

    def poison(self, block_ids: list[int]) -> None:
        """Fill ``block_ids`` with ``poison_value()`` in every layer, so any later read of
        them shows."""
        _fill(self.keys + self.values, block_ids, self.poison_value())

    def poison_slots(self, slots: list[int]) -> None:
        """Fill the rows ``slots`` (``block_id * block_size + offset``) with ``poison_value()``
        in every layer."""
        _fill(self._flat_keys + self._flat_values, slots, self.poison_value())

    def poison_value(self) -> float:
        """What ``poison`` writes: NaN, which ruins any arithmetic that touches it."""
        return float("nan")


class PoisonedKVPool(PagedKVPool):
    """A paged pool that fills every released block with NaN (``--poison-freed``).

    NOTE: a use-after-free or a stale block-table entry reads K/V another request wrote,
    which rarely moves a greedy token on a roomy pool; NaN turns any such read into NaN
    logits at once. It relies on attention reading exactly each request's own tokens.
    The engine hands it only blocks no table holds and no prefix cache entry names: a
    cached free block keeps its K/V for a later prefix hit, so it cannot be poisoned.
    """

    __slots__ = ()

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """Poison the released blocks."""
        self.poison(block_ids)

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """Poison the blocks and the slots the rollback gave up."""
        self.poison(block_ids)
        self.poison_slots(slots)

    def release_out_of_window(self, block_ids: list[int]) -> None:
        """Poison the blocks sliding windows released, at once: the request still runs,
        and a hook reading one would turn its logits NaN."""
        self.poison(block_ids)


class FinitePoisonedKVPool(PoisonedKVPool):
    """A poisoned pool whose poison is the dtype's largest finite value, not NaN.

    NOTE: for a kernel that reads a whole partly filled block and masks the rows past
    ``seqused_k`` (FlexAttention does): a masked score is replaced by ``-inf``, but P·V
    still multiplies the masked row's V by its zero weight, and ``0 * NaN`` is NaN, so a
    NaN poison would ruin correct reads. ``0 * max`` is 0. A real read of a poisoned row
    still shows: ``q · k`` with ``k = max`` overflows to ``inf`` (or NaN), and the softmax
    and ``p * max`` carry it to the logits.
    """

    __slots__ = ()

    def poison_value(self) -> float:
        """The largest finite value of the pool's dtype."""
        return torch.finfo(self.layout.dtype).max


class ContiguousKVBuffers:
    """Each request's K/V in its own buffer, by position: the gate's paging-free twin.

    Request ``r`` owns one row of a per-layer ``[rows, row_tokens, num_kv_heads, head_dim]``
    tensor (``row_tokens``: ``max_tokens`` rounded up to ``block_size``); token ``t`` lives
    at position ``t`` of its row. No block id from the manager is used. A kernel backend
    reads the same memory as pages (``pages``): the row of ``r`` is the run of pages
    ``block_ids_of(r)``, in order, so the kernel reads contiguous buffers through a table
    that is an ``arange``.
    """

    __slots__ = ("_free_rows", "_keys", "_rows", "_values", "block_size", "layout", "row_tokens")

    def __init__(self, layout: KVLayout, max_tokens: int, block_size: int = 1) -> None:
        if max_tokens < 1 or block_size < 1:
            raise ValueError(
                f"max_tokens and block_size must be >= 1, got {max_tokens}, {block_size}"
            )
        self.layout = layout
        self.block_size = block_size
        self.row_tokens = -(-max_tokens // block_size) * block_size
        shape = (0, self.row_tokens, layout.num_kv_heads, layout.head_dim)
        # _keys[l], _values[l]: [rows, row_tokens, num_kv_heads, head_dim]
        self._keys = [
            torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for _ in range(layout.num_layers)
        ]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._rows: dict[str, int] = {}  # request_id -> its row
        self._free_rows: list[int] = []

    def plan(
        self,
        tables: Sequence[RequestBlockTable],
        new_slots: Sequence[list[int]],
        group_tables: Sequence[Sequence[RequestBlockTable]] = (),
    ) -> KVPlan:
        """Rows are positions in each request's own buffer; block tables are not used (nor
        windows: every position is kept)."""
        device = self.layout.device
        rows: list[int] = []
        for table, slots in zip(tables, new_slots, strict=True):
            if table.request_id not in self._rows:
                self._rows[table.request_id] = self._take_row()
            base = self._rows[table.request_id] * self.row_tokens
            rows.extend(range(base + table.token_count - len(slots), base + table.token_count))
        everything = GroupPlan(
            write_index=torch.tensor(rows, dtype=torch.int64, device=device),
            read_index=torch.empty(0, dtype=torch.int64, device=device),
            read_starts=(0,) * len(tables),
            first_positions=(0,) * len(tables),
        )
        return KVPlan(
            request_ids=tuple(table.request_id for table in tables),
            new_token_counts=tuple(len(slots) for slots in new_slots),
            token_counts=tuple(table.token_count for table in tables),
            groups=(everything,),
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
            read.append((_sdpa_layout(keys[row, :count]), _sdpa_layout(values[row, :count])))
        return read

    def pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s buffers as pages ``[pages, block_size, num_kv_heads, head_dim]``
        (views, no copy)."""
        shape = (-1, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        return self._keys[layer_idx].view(shape), self._values[layer_idx].view(shape)

    def block_ids_of(self, table: RequestBlockTable) -> list[int]:
        """The pages of ``table``'s request that hold its ``token_count`` tokens, in order."""
        first = self._rows[table.request_id] * (self.row_tokens // self.block_size)
        return list(range(first, first + -(-table.token_count // self.block_size)))

    def first_positions(self, layer_idx: int, plan: KVPlan) -> tuple[int, ...]:
        """Every request's buffer starts at position 0."""
        return plan.groups[0].first_positions

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """Give back a finished request's row (its block ids mean nothing here)."""
        self._free_rows.append(self._rows.pop(request_id))

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """Nothing to do: rows past a request's length are never read, and are rewritten."""

    def release_out_of_window(self, block_ids: list[int]) -> None:
        """Nothing to drop: buffers keep every position."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with a copy of the parent's buffers: nothing is shared here."""
        parent, child = self._rows[parent_id], self._take_row()
        self._rows[child_id] = child
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[child] = keys[parent]
            values[child] = values[parent]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Nothing to copy: no two requests share a buffer."""

    def _take_row(self) -> int:
        """A zeroed row for a new request: a freed one, else one more (the tensors grow).

        NOTE: growing doubles the rows, copying every layer (a handful of times per run);
        a zeroed row keeps what a fresh per-request buffer had.
        """
        if not self._free_rows:
            rows = self._keys[0].shape[0]
            grown = max(1, 2 * rows)
            self._keys = [_grown(keys, grown) for keys in self._keys]
            self._values = [_grown(values, grown) for values in self._values]
            self._free_rows.extend(range(grown - 1, rows - 1, -1))
        row = self._free_rows.pop()
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[row].zero_()
            values[row].zero_()
        return row


def _grown(buffers: torch.Tensor, rows: int) -> torch.Tensor:
    """``buffers`` ``[old_rows, ...]`` copied into a zeroed ``[rows, ...]`` tensor."""
    grown = torch.zeros((rows, *buffers.shape[1:]), dtype=buffers.dtype, device=buffers.device)
    grown[: buffers.shape[0]] = buffers
    return grown


def _fill(tensors: list[torch.Tensor], rows: list[int], value: float) -> None:
    """``value`` into ``rows`` (indices along dim 0) of every tensor."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)
    for tensor in tensors:
        tensor.index_fill_(0, index, value)


def _sdpa_layout(rows: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` rows as a ``[1, num_kv_heads, tokens, head_dim]`` view.

    NOTE: a strided view, not a copy: SDPA gives the same bits on it as on HF's contiguous
    cache (check 2 measures it), and a ``.contiguous()`` cost two copies per request per
    layer.
    """
    return rows.flatten(0, -3).transpose(0, 1).unsqueeze(0)
