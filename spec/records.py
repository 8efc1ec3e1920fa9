"""The value records of the article's API: a block, a request's table, a usage report.

All frozen and hashable, so that a spec state is. ``KVBlock``, ``ReleasedBlocks`` and
``KVBlockUsage`` are what impl hands out too; impl's ``RequestBlockTable`` and
``PromptAllocation`` are the article's mutable twins of the ones here (a ``list`` of block
ids), and ``spec.api.as_article`` maps these to those in one place.
"""

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
class PromptAllocation:
    """What ``allocate_prompt`` gives: the new table and how many prompt tokens hit the cache.

    The first ``cached_tokens`` tokens' K/V are already in the pool; the engine computes
    only the rest.
    """

    table: RequestBlockTable
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ReleasedBlocks:
    """What ``release_blocks`` and ``preempt`` report: a request's blocks in table order
    (every KV cache group's table, group 0's first), and which of them became free.

    ``freed_block_ids`` went to the free queue (their K/V is dead: nothing may read it
    again); ``cached_block_ids`` went to the cached free queue (a prefix hit may revive
    them as they are). Both in release order: group by group, last block first. A block
    another table still holds is in neither.

    ``stale_slots[g]`` (``truncate_blocks`` only; empty otherwise) lists, in position
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
    """What a step needs of one request, in every KV cache group at once: ``tables[g]`` is
    its table in group g after the call, and ``slots[g][i]`` the pool slot the i-th new
    token's K/V goes to in group g (``slot_index`` of each new position)."""

    tables: tuple[RequestBlockTable, ...]
    slots: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class SwappedOut:
    """What ``swap_out`` reports: the request's device blocks in table order (every group's,
    group 0's first) and the host block each is copied to, at the same index.

    ``freed_block_ids`` and ``cached_block_ids`` (release order) are the device blocks no
    table holds any more: in flight until ``take_swap_copies``, then free (the KV pool may
    poison them once it has copied them out) or cached free. A block another table still
    holds is in neither.
    """

    block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]
    freed_block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwapCopies:
    """The copies between the tiers to make now, in order: every ``device_to_host``
    (device block, host block) first, then the copy-on-write ones, then every
    ``host_to_device`` (host block, device block)."""

    device_to_host: tuple[tuple[int, int], ...]
    host_to_device: tuple[tuple[int, int], ...]
