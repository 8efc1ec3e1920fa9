"""Where K/V tensors live: the paged pool, and the contiguous buffers the allocator gate uses.

``PagedKVPool`` is the real thing: per layer one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a request lives in
row ``slot = block_ids[t // block_size] * block_size + t % block_size`` of the flat view
``[num_blocks * block_size, num_kv_heads, head_dim]``; the slots come from
``impl.KVBlockManager`` and nothing else. Layout, block-major then token then head:
- a block is one contiguous chunk of memory, so releasing or poisoning a block is one
  slice write, and a request's K/V for one block is one contiguous read;
- the flat view is a free reshape, so writing a step's new tokens is one ``index_copy_``
  and reading a request is one ``index_select`` by slot;
- ``[num_kv_heads, head_dim]`` last matches the ``[tokens, heads, dim]`` rows the model's
  projections produce, so a write needs no transpose.

``ContiguousKVBuffers`` keeps each request's K/V in its own ``[max_tokens, ...]`` buffer,
indexed by position: no block ids at all. The allocator gate runs the same engine on both
and demands bit-identical logits.

Neither decides *when* a request gets memory: that is the engine's job (with the manager).
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The K/V shape of a model: layers, KV heads, head dim, dtype and device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Where one request's K/V go and come from in one forward step (shared by all layers).

    ``write_index`` holds the rows the step's new tokens are written to and ``read_index``
    the rows of all the request's tokens, oldest first; what a row means is the store's.
    """

    request_id: str
    write_index: torch.Tensor  # [new_tokens] int64
    read_index: torch.Tensor  # [token_count] int64
    token_count: int


class KVStore(Protocol):
    """What the attention hook needs from K/V memory: plan once per step, write, read.

    The engine also tells it about the lifecycle: ``release`` (with the blocks that became
    free and hold no cached prefix: a shared or cached block keeps valid K/V), ``fork``
    and the copy-on-write ``copy_blocks``.
    """

    def plan(
        self, request_id: str, block_ids: tuple[int, ...], token_count: int, new_slots: list[int]
    ) -> KVPlan: ...

    def write(
        self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor
    ) -> None: ...

    def read(self, layer_idx: int, plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]: ...

    def release(self, request_id: str, block_ids: list[int]) -> None: ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


class PagedKVPool:
    """The paged KV pool: ``num_blocks`` blocks of ``block_size`` tokens for every layer."""

    __slots__ = (
        "_flat_keys",
        "_flat_values",
        "block_size",
        "keys",
        "layout",
        "num_blocks",
        "values",
    )

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        # keys[l], values[l]: [num_blocks, block_size, num_kv_heads, head_dim]
        self.keys = [
            torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for _ in range(layout.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        flat = (num_blocks * block_size, layout.num_kv_heads, layout.head_dim)
        # Views sharing the storage above: [num_blocks * block_size, num_kv_heads, head_dim]
        self._flat_keys = [k.view(flat) for k in self.keys]
        self._flat_values = [v.view(flat) for v in self.values]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds for K and V over all layers."""
        return self.num_blocks * self.block_size * self.layout.bytes_per_token

    def plan(
        self, request_id: str, block_ids: tuple[int, ...], token_count: int, new_slots: list[int]
    ) -> KVPlan:
        """Rows are pool slots: new tokens go to ``new_slots``, reads follow ``block_ids``."""
        device = self.layout.device
        block_size = self.block_size
        table = torch.tensor(block_ids, dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64)
        # Every slot of every block of the table, in token order, cut to token_count.
        read_index = (table[:, None] * block_size + offsets[None, :]).reshape(-1)[:token_count]
        return KVPlan(
            request_id=request_id,
            write_index=torch.tensor(new_slots, dtype=torch.int64, device=device),
            read_index=read_index.to(device),
            token_count=token_count,
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' ``key``/``value`` ``[new_tokens, num_kv_heads, head_dim]``."""
        self._flat_keys[layer_idx].index_copy_(0, plan.write_index, key)
        self._flat_values[layer_idx].index_copy_(0, plan.write_index, value)

    def read(self, layer_idx: int, plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's K and V, ``[token_count, num_kv_heads, head_dim]`` each."""
        keys = self._flat_keys[layer_idx].index_select(0, plan.read_index)
        values = self._flat_values[layer_idx].index_select(0, plan.read_index)
        return keys, values

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

    def plan(
        self, request_id: str, block_ids: tuple[int, ...], token_count: int, new_slots: list[int]
    ) -> KVPlan:
        """Rows are positions in the request's own buffer; the block table is not used."""
        if request_id not in self._buffers:
            shape = (self.max_tokens, self.layout.num_kv_heads, self.layout.head_dim)
            self._buffers[request_id] = [
                (
                    torch.zeros(shape, dtype=self.layout.dtype, device=self.layout.device),
                    torch.zeros(shape, dtype=self.layout.dtype, device=self.layout.device),
                )
                for _ in range(self.layout.num_layers)
            ]
        first_new = token_count - len(new_slots)
        device = self.layout.device
        return KVPlan(
            request_id=request_id,
            write_index=torch.arange(first_new, token_count, dtype=torch.int64, device=device),
            read_index=torch.arange(token_count, dtype=torch.int64, device=device),
            token_count=token_count,
        )

    def write(self, layer_idx: int, plan: KVPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens at their positions in the request's buffer."""
        keys, values = self._buffers[plan.request_id][layer_idx]
        keys.index_copy_(0, plan.write_index, key)
        values.index_copy_(0, plan.write_index, value)

    def read(self, layer_idx: int, plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``token_count`` rows of the request's buffer."""
        keys, values = self._buffers[plan.request_id][layer_idx]
        return keys[: plan.token_count], values[: plan.token_count]

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
