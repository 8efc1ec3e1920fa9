"""Where K/V tensors live: the paged pool, and the contiguous buffers the allocator gate uses.

``PagedKVPool`` is the real thing: per layer one K and one V tensor of shape
``[total_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a request lives in
row ``slot = block_ids[t // block_size] * block_size + t % block_size`` of the flat view
``[total_blocks * block_size, num_kv_heads, head_dim]``; the slots come from
``impl.KVBlockManager`` and nothing else. Layout, block-major then token then head:
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

from impl import RequestBlockTable


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The K/V shape of a model: layers, KV heads, head dim, dtype and device.

    ``layer_windows[l]`` is layer ``l``'s sliding window in tokens (its query at position
    ``q`` reads keys ``q - W + 1 .. q``), or ``None`` for full attention; empty when no
    layer has a window.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, or ``None`` for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Where one forward step's K/V go and come from (shared by all layers).

    The step packs ``len(request_ids)`` requests; ``write_index`` holds the rows of every
    new token of the step in packed order, and ``new_token_counts`` how many of them each
    request feeds. ``read_index`` says what a read gathers and ``read_starts`` where each
    request's ``token_counts[i]`` rows begin in the gathered rows; what an index means is
    the store's.
    """

    request_ids: tuple[str, ...]
    write_index: torch.Tensor  # [step_tokens] int64
    new_token_counts: tuple[int, ...]
    read_index: torch.Tensor  # int64, the store's rows or blocks to gather
    read_starts: tuple[int, ...]
    token_counts: tuple[int, ...]


class KVStore(Protocol):
    """What the attention hook needs from K/V memory: plan once per step, write, read.

    ``plan`` takes each request's table after this step's tokens and the slots of those
    tokens. The engine also tells it about the lifecycle: ``release`` (with the blocks
    that became free and hold no cached prefix: a shared or cached block keeps valid K/V),
    ``fork`` and the copy-on-write ``copy_blocks``.
    """

    def plan(self, tables: Sequence[RequestBlockTable], new_slots: Sequence[list[int]]) -> KVPlan:
        """The step's plan, built once and used by every layer."""
        ...

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new ``key``/``value`` rows ``[step_tokens, num_kv_heads, head_dim]``."""
        ...

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's K and V in SDPA's layout, ``[1, num_kv_heads, token_count, head_dim]``
        (strided views are fine), in plan order."""
        ...

    def release(self, request_id: str, block_ids: list[int]) -> None: ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


class PagedKVPool:
    """The paged KV pool: ``total_blocks`` blocks of ``block_size`` tokens for every layer."""

    __slots__ = (
        "_flat_keys",
        "_flat_values",
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
        # keys[l], values[l]: [total_blocks, block_size, num_kv_heads, head_dim]
        self.keys = [
            torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for _ in range(layout.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        flat = (total_blocks * block_size, layout.num_kv_heads, layout.head_dim)
        # Views sharing the storage above: [total_blocks * block_size, num_kv_heads, head_dim]
        self._flat_keys = [k.view(flat) for k in self.keys]
        self._flat_values = [v.view(flat) for v in self.values]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds for K and V over all layers."""
        return self.total_blocks * self.block_size * self.layout.bytes_per_token

    def plan(self, tables: Sequence[RequestBlockTable], new_slots: Sequence[list[int]]) -> KVPlan:
        """Writes go to the pool slots ``new_slots``; a read gathers the tables' blocks whole.

        NOTE: reading by block, not by slot, moves ``block_size`` rows per index (one
        memcpy-sized chunk) and one ``index_select`` serves every request of the step; it
        copies at most ``block_size - 1`` unused rows per request, which no one reads.
        """
        device = self.layout.device
        block_counts = [len(table.block_ids) for table in tables]
        return KVPlan(
            request_ids=tuple(table.request_id for table in tables),
            write_index=torch.tensor(
                [slot for slots in new_slots for slot in slots], dtype=torch.int64, device=device
            ),
            new_token_counts=tuple(len(slots) for slots in new_slots),
            read_index=torch.tensor(
                [block_id for table in tables for block_id in table.block_ids],
                dtype=torch.int64,
                device=device,
            ),
            read_starts=tuple(
                self.block_size * start for start in accumulate(block_counts, initial=0)
            )[:-1],
            token_counts=tuple(table.token_count for table in tables),
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new ``key``/``value`` ``[step_tokens, num_kv_heads, head_dim]``."""
        self._flat_keys[layer_idx].index_copy_(0, plan.write_index, key)
        self._flat_values[layer_idx].index_copy_(0, plan.write_index, value)

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's K and V, ``[1, num_kv_heads, token_count, head_dim]``: views of one
        gather."""
        keys = _sdpa_layout(self.keys[layer_idx].index_select(0, plan.read_index))
        values = _sdpa_layout(self.values[layer_idx].index_select(0, plan.read_index))
        return [
            (keys[:, :, start : start + count], values[:, :, start : start + count])
            for start, count in zip(plan.read_starts, plan.token_counts, strict=True)
        ]

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """A request let go of ``block_ids``; their rows keep stale K/V until overwritten."""

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
        """Fill ``block_ids`` with NaN in every layer, so any later read of them shows."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.layout.device)
        for keys, values in zip(self.keys, self.values, strict=True):
            keys.index_fill_(0, index, float("nan"))
            values.index_fill_(0, index, float("nan"))


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


class ContiguousKVBuffers:
    """Each request's K/V in its own buffer, by position: the gate's paging-free twin."""

    __slots__ = ("_buffers", "layout", "max_tokens")

    def __init__(self, layout: KVLayout, max_tokens: int) -> None:
        self.layout = layout
        self.max_tokens = max_tokens
        # request_id -> per layer (keys, values), each [max_tokens, num_kv_heads, head_dim]
        self._buffers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def plan(self, tables: Sequence[RequestBlockTable], new_slots: Sequence[list[int]]) -> KVPlan:
        """Rows are positions in each request's own buffer; block tables are not used."""
        device = self.layout.device
        shape = (self.max_tokens, self.layout.num_kv_heads, self.layout.head_dim)
        positions: list[int] = []
        for table, slots in zip(tables, new_slots, strict=True):
            if table.request_id not in self._buffers:
                self._buffers[table.request_id] = [
                    (
                        torch.zeros(shape, dtype=self.layout.dtype, device=device),
                        torch.zeros(shape, dtype=self.layout.dtype, device=device),
                    )
                    for _ in range(self.layout.num_layers)
                ]
            positions.extend(range(table.token_count - len(slots), table.token_count))
        return KVPlan(
            request_ids=tuple(table.request_id for table in tables),
            write_index=torch.tensor(positions, dtype=torch.int64, device=device),
            new_token_counts=tuple(len(slots) for slots in new_slots),
            read_index=torch.empty(0, dtype=torch.int64, device=device),
            read_starts=(0,) * len(tables),
            token_counts=tuple(table.token_count for table in tables),
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store each request's new tokens at their positions in its own buffer."""
        start = 0
        for request_id, count in zip(plan.request_ids, plan.new_token_counts, strict=True):
            keys, values = self._buffers[request_id][layer_idx]
            index = plan.write_index[start : start + count]
            keys.index_copy_(0, index, key[start : start + count])
            values.index_copy_(0, index, value[start : start + count])
            start += count

    def read(self, layer_idx: int, plan: KVPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``token_count`` rows of each request's buffer, in SDPA's layout."""
        read = []
        for request_id, count in zip(plan.request_ids, plan.token_counts, strict=True):
            keys, values = self._buffers[request_id][layer_idx]
            read.append((_sdpa_layout(keys[:count]), _sdpa_layout(values[:count])))
        return read

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """Drop a finished request's buffers (its block ids mean nothing here)."""
        del self._buffers[request_id]

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with a copy of the parent's buffers: nothing is shared here."""
        self._buffers[child_id] = [
            (keys.clone(), values.clone()) for keys, values in self._buffers[parent_id]
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Nothing to copy: no two requests share a buffer."""


def _sdpa_layout(rows: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` rows as a ``[1, num_kv_heads, tokens, head_dim]`` view.

    NOTE: a strided view, not a copy: SDPA gives the same bits on it as on HF's contiguous
    cache (check 2 measures it), and a ``.contiguous()`` cost two copies per request per
    layer.
    """
    return rows.flatten(0, -3).transpose(0, 1).unsqueeze(0)
