"""The paged KV pool: where K/V tensors live, addressed by the manager's block tables.

``PagedKVPool`` holds per layer one K and one V tensor of shape
``[total_blocks, block_size, num_kv_heads, head_dim]`` (with sliding windows, per layer of
a KV cache group, shared by the groups: ``harness.kv_layout.kv_cache_groups``). Token ``t``
of a request lives in row ``spec.slot_index(block_size, block_ids, t, skipped_blocks)`` of
the flat view ``[total_blocks * block_size, num_kv_heads, head_dim]``, through the table
of its layer's group; the slots come from ``impl.KVCacheManager`` and nothing else.
Layout, block-major then token then head:
- a block is one contiguous chunk of memory, so releasing or poisoning a block is one
  slice write, and a request's K/V for one block is one contiguous read;
- the flat view is a free reshape, so writing a step's new tokens is one ``index_copy_``
  by slot, and reading every request of a step is one ``index_select`` by block;
- ``[num_kv_heads, head_dim]`` last matches the ``[tokens, heads, dim]`` rows the model's
  projections produce, so a write needs no transpose.

With ``host_blocks > 0`` the pool keeps a host tier beside it (``harness.runtime.host_store``)
and makes the manager's copies between the two (``transfer``). The poisoned pools fill
what is released with a poison, so a read of it shows. The
paging-free twin the allocator gate compares with is ``harness.runtime.contiguous_kv``.
Neither decides *when* a request gets memory: that is the engine's job (with the manager).
"""

from collections.abc import Sequence
from itertools import accumulate

import torch

from harness.kv_layout import KVLayout
from harness.runtime.host_store import HostKVStore
from harness.runtime.kv_store import GroupPlan, KVPlan, sdpa_layout
from harness.runtime.state_store import StateRows
from impl import AppendedSlots, KVCacheManager, Transfers
from impl.prefix_cache import EventSink
from spec import RequestBlockTable


def new_manager(
    layout: KVLayout,
    total_blocks: int,
    block_size: int,
    *,
    event_sink: EventSink | None = None,
    host_blocks: int = 0,
    host_prefix_cache: bool = False,
    host_event_sink: EventSink | None = None,
) -> KVCacheManager:
    """A manager for a pool of ``layout``: one KV cache group per group of its layers, and
    a host tier of ``host_blocks`` (keeping freed cached prefixes with ``host_prefix_cache``);
    its KV cache events go to ``event_sink``, its host cache's to ``host_event_sink``
    (``impl.KVCacheManager``'s)."""
    return KVCacheManager(
        total_blocks,
        block_size,
        group_windows=layout.group_windows,
        event_sink=event_sink,
        host_blocks=host_blocks,
        host_prefix_cache=host_prefix_cache,
        host_event_sink=host_event_sink,
    )


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
        "host",
        "keys",
        "layout",
        "states",
        "total_blocks",
        "values",
    )

    def __init__(
        self, layout: KVLayout, total_blocks: int, block_size: int, host_blocks: int = 0
    ) -> None:
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
            if group != layout.state_group
            for index, layer_idx in enumerate(layers)
        }
        # A hybrid's state layers hold no K/V, unless they attend too: (-1, -1)
        self._places = tuple(places.get(i, (-1, -1)) for i in range(layout.num_layers))
        self.host = HostKVStore(layout, host_blocks, block_size)
        # A hybrid's recurrent states, one row per block id (the state group's)
        self.states = StateRows(layout, total_blocks if layout.state_layers else 0)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds for K and V over all layers."""
        return self.total_blocks * self.block_size * self.layout.bytes_per_block_token

    def plan(self, steps: Sequence[AppendedSlots]) -> KVPlan:
        """Writes go to the slots the manager gave each request of the step, group by
        group; a read gathers each group's held blocks whole.

        NOTE: reading by block, not by slot, moves ``block_size`` rows per index (one
        memcpy-sized chunk) and one ``index_select`` serves every request of the step; it
        copies at most ``block_size - 1`` unused rows per request, which no one reads.
        """
        groups = len(self.layout.group_layers)
        if steps and len(steps[0].block_ids) != groups:
            raise ValueError(
                f"the pool has {groups} KV cache groups, the plan {len(steps[0].block_ids)}"
            )
        state = self.layout.state_group
        return KVPlan(
            request_ids=tuple(step.request_id for step in steps),
            new_token_counts=tuple(len(step.slots[0]) for step in steps),
            token_counts=tuple(step.token_count for step in steps),
            groups=tuple(self._group_plan(steps, group) for group in range(groups)),
            # A state group's table holds one block: the request's running state.
            state_rows=() if state is None else tuple(step.block_ids[state][0] for step in steps),
        )

    def _group_plan(self, steps: Sequence[AppendedSlots], group: int) -> GroupPlan:
        device = self.layout.device
        block_counts = [len(step.block_ids[group]) for step in steps]
        return GroupPlan(
            write_index=torch.tensor(
                [slot for step in steps for slot in step.slots[group]],
                dtype=torch.int64,
                device=device,
            ),
            read_index=torch.tensor(
                [block_id for step in steps for block_id in step.block_ids[group]],
                dtype=torch.int64,
                device=device,
            ),
            read_starts=tuple(
                self.block_size * start for start in accumulate(block_counts, initial=0)
            )[:-1],
            first_positions=tuple(self.block_size * step.skipped_blocks[group] for step in steps),
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
        keys = sdpa_layout(self.keys[index].index_select(0, group_plan.read_index))
        values = sdpa_layout(self.values[index].index_select(0, group_plan.read_index))
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

    def fork(self, parent_id: str, child_id: str) -> None:
        """Nothing to do: the child's table names the parent's blocks."""

    def transfer(self, transfers: Transfers) -> None:
        """The manager's transfers in its order: every copy out to the host tier (one batched
        copy per tensor), every copy-on-write copy, every copy in; then the skipped blocks
        (``release_skipped``)."""
        self.host.copy_out(self.keys + self.values, transfers.device_to_host)
        self.copy_blocks(transfers.copies)
        self.host.copy_in(self.keys + self.values, transfers.host_to_device)
        if transfers.skipped_block_ids:
            self.release_skipped(list(transfers.skipped_block_ids))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's K and V rows of each ``source`` block to ``destination``,
        and its state rows (a hybrid's state group copies its states so: a checkpoint, a
        hit, a fork's first write).

        In order, so a destination of one pair could be a later pair's source.
        """
        self.copy_states(copies)
        device = self.layout.device
        for source, destination in copies:
            source_index = torch.tensor([source], dtype=torch.int64, device=device)
            destination_index = torch.tensor([destination], dtype=torch.int64, device=device)
            for keys, values in zip(self.keys, self.values, strict=True):
                # keys.index_select(...): [1, block_size, num_kv_heads, head_dim]
                keys.index_copy_(0, destination_index, keys.index_select(0, source_index))
                values.index_copy_(0, destination_index, values.index_select(0, source_index))

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """The state rows of each ``(source, destination)`` pair, in order."""
        self.states.copy(copies)

    def release_skipped(self, block_ids: list[int]) -> None:
        """Sliding windows let go of ``block_ids``; their rows keep stale K/V."""

    def swap_out(self, request_id: str, block_ids: list[int]) -> None:
        """A request was swapped out and its copies out made; ``block_ids`` became free
        and uncached. Their rows keep stale K/V until overwritten."""

    def poison(self, block_ids: list[int]) -> None:
        """Fill ``block_ids`` with ``poison_value()`` in every layer, state rows too, so any
        later read of them shows."""
        _fill(self.keys + self.values, block_ids, self.poison_value())
        self.poison_states(block_ids)

    def poison_states(self, block_ids: list[int]) -> None:
        """Fill the state rows of ``block_ids`` with ``poison_value()``."""
        self.states.fill(block_ids, self.poison_value())

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

    def swap_out(self, request_id: str, block_ids: list[int]) -> None:
        """Poison the blocks a swap-out released: the engine calls this only after their
        copies out were made, or the host tier would keep NaN."""
        self.poison(block_ids)

    def truncate(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """Poison the blocks and the slots the rollback gave up."""
        self.poison(block_ids)
        self.poison_slots(slots)

    def release_skipped(self, block_ids: list[int]) -> None:
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


def _fill(tensors: list[torch.Tensor], rows: list[int], value: float) -> None:
    """``value`` into ``rows`` (indices along dim 0) of every tensor."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)
    for tensor in tensors:
        tensor.index_fill_(0, index, value)
