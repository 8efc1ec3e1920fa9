"""The value records the operations hand out: a block, a request's table, what an
allocate or append gives, what a release gives back, the transfers a step makes, a usage
report.

All frozen and hashable, so that a spec state is. ``KVBlock``, ``ReleasedBlocks``,
``Transfers`` and ``KVBlockUsage`` are what impl hands out too; impl's
``RequestBlockTable`` is the article's mutable twin of the one here (a ``list`` of block
ids) and its ``AppendedSlots`` a faster-built twin, and ``impl.spec_backed.as_impl`` maps
these to those in one place.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class CacheKey(NamedTuple):
    """What a cached full block is cached under: the cache salt of the request that cached it
    (``None`` is a namespace of its own) and the whole token prefix the block ends.

    The salt is part of the key, so two tenants' equal prompts never share a block, and no
    hash collision can cross from one salt to another (vLLM's ``cache_salt``).
    """

    cache_salt: str | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One fixed-size block of the KV pool: its id and how many tokens it holds when full."""

    block_id: int
    capacity_tokens: int


@dataclass(frozen=True, slots=True)
class RequestBlockTable:
    """A request's block table in one KV cache group: its blocks in token order and the
    tokens they hold.

    ``skipped_blocks`` (vLLM's word) counts the leading block indices a sliding window
    released: ``block_ids[i]`` holds block index ``skipped_blocks + i``, i.e. positions
    ``(skipped_blocks + i) * block_size`` onwards. Always 0 in a full-attention group.
    """

    request_id: str
    block_ids: tuple[int, ...]
    token_count: int
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ReleasedBlocks:
    """What ``release``, ``preempt``, ``truncate`` and ``swap_out`` report: a request's blocks
    in table order (every KV cache group's table, group 0's first; ``truncate``: those it
    dropped), and which of them became free.

    ``freed_block_ids`` went to the free queue (their K/V is dead: nothing may read it
    again); ``cached_block_ids`` went to the cached free queue (a prefix hit may hold them
    again as they are). Both in release order: group by group, last block first. A block
    another table still holds is in neither. After ``swap_out`` both are in flight until
    ``take_transfers`` hands their copies out over, and only then free (the KV pool may
    poison the first kind once it has copied them out); a swapped-out request's
    ``release`` reports no block of its own, and the in-flight blocks its host blocks'
    dropped copies let join the queues.

    ``stale_slots[g]`` (``truncate`` only; empty otherwise) lists, in position
    order, the pool slots of group g that the rollback made stale in a kept last block
    only this request holds: rows a rejected draft wrote that the request will write
    again. A kept block another table holds is not listed: its K/V is that table's too.
    """

    block_ids: tuple[int, ...]
    freed_block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...]
    stale_slots: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class KVBlockUsage:
    """A snapshot of the pool: blocks in use and free, requests, tokens, and sharing counters.

    ``free_blocks`` counts every block an allocation may take, cached ones included.
    ``allocated_tokens`` sums the requests' token counts (once per request, whatever the
    number of KV cache groups), so with shared blocks it can exceed ``reserved_tokens``
    (the tokens' K/V is stored once, counted per request). ``reserved_tokens`` sums over
    the groups and ``group_reserved_tokens`` splits it, one entry per group (an allocator
    always fills it; the empty default only lets a report be built by hand).
    ``skipped_blocks`` counts the table entries sliding windows released so far.
    ``cached_free_blocks`` are the free blocks that still hold a cached prefix;
    ``table_blocks`` counts the blocks the tables hold over every group, a block once per
    table (so it exceeds the blocks in use by what sharing saves), and
    ``table_skipped_blocks`` the leading blocks the running tables' windows released.

    The host tier (``spec.host_tier``; all 0 without one): ``host_blocks`` in it,
    ``host_free_blocks`` a swap-out may take now, ``host_swapped_blocks`` held by
    ``swapped_requests``, ``host_cached_blocks`` holding demoted prefixes; the running
    totals ``swapped_out_blocks`` and ``swapped_in_blocks`` (device blocks copied out and
    back) and ``host_hit_blocks`` (prefix-hit blocks found on the host only).
    """

    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    request_count: int
    allocated_tokens: int
    reserved_tokens: int
    cached_blocks: int = 0
    shared_blocks: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    preemptions: int = 0
    group_reserved_tokens: tuple[int, ...] = ()
    skipped_blocks: int = 0
    host_blocks: int = 0
    host_free_blocks: int = 0
    host_swapped_blocks: int = 0
    host_cached_blocks: int = 0
    swapped_requests: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    host_hit_blocks: int = 0
    cached_free_blocks: int = 0
    table_blocks: int = 0
    table_skipped_blocks: int = 0

    @property
    def internal_fragmentation_tokens(self) -> int:
        """Token slots reserved in used blocks but not yet holding a token."""
        return self.reserved_tokens - self.allocated_tokens

    @property
    def block_utilization(self) -> float:
        """Share of reserved token slots that hold a token; 0.0 when nothing is reserved."""
        if self.reserved_tokens == 0:
            return 0.0
        return self.allocated_tokens / self.reserved_tokens


@dataclass(frozen=True, slots=True)
class AppendedSlots:
    """What ``allocate`` and ``append`` give: one request after the call, in every KV cache
    group at once, and where the K/V of the tokens the forward computes go.

    ``block_ids[g]`` and ``skipped_blocks[g]`` are its table in group g (``RequestBlockTable``
    without the id and length: ``table(g)`` builds it); ``slots[g][i]`` is the pool slot of
    the i-th token the call added that is not cached, in group g (``slot_index`` of each
    position from ``token_count - len(slots[g])`` on). ``cached_tokens`` of the call's tokens
    were found cached (a prompt's prefix hit; 0 for an append): their K/V is in the pool.
    """

    request_id: str
    token_count: int
    block_ids: tuple[tuple[int, ...], ...]
    skipped_blocks: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    cached_tokens: int = 0

    def table(self, group: int = 0) -> RequestBlockTable:
        """The request's table in KV cache group ``group``."""
        return RequestBlockTable(
            self.request_id, self.block_ids[group], self.token_count, self.skipped_blocks[group]
        )


@dataclass(frozen=True, slots=True)
class Transfers:
    """What ``take_transfers`` hands over: what the KV pool does with the pool's memory
    before the next forward, in this order. Every ``device_to_host`` (device block, host
    block) copy first, then every copy-on-write ``copies`` (source block, destination
    block), then every ``host_to_device`` (host block, device block) copy, each kind in the
    order it was made; then ``skipped_block_ids``, the blocks sliding windows made free and
    uncached (their K/V is dead: nothing may read it again)."""

    device_to_host: tuple[tuple[int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    host_to_device: tuple[tuple[int, int], ...] = ()
    skipped_block_ids: tuple[int, ...] = ()


class GroupView(NamedTuple):
    """One KV cache group of a state, as its kind's invariants read it
    (``spec.invariants``): its tables and cache, and the pool's token ids and salts."""

    block_size: int
    tables: Mapping[str, RequestBlockTable]
    cache: Mapping[CacheKey, int]
    token_ids: Mapping[str, tuple[int, ...]]
    cache_salts: Mapping[str, str]
