"""The allocator's state: the frozen record every transition takes and returns, ``init``,
and the queries that read it (tables, free blocks, usage).

Frozen data and pure functions: every operation takes a state and returns a new one,
never touching its argument. This is the definition of correct behaviour, written to be
read, not to be fast (impl/ is the fast one and is tested against it). The transitions
live by family, each in a module named for it: ``spec.growth`` (allocate, append: blocks
taken, the window rule, copy-on-write), ``spec.releasing`` (release, preempt, truncate),
``spec.sharing`` (fork), ``spec.caching`` (the prefix cache: its hit rule, what it caches,
reset), ``spec.swap`` (the host tier), and ``spec.blocks`` (where a block comes from and
where it goes, which they all share). ``spec.api`` is the one table of operations.

Block order is part of the contract, so that impl can be compared with it exactly:
- ``init`` lays the free queue out as 0, 1, ..., total_blocks - 1;
- a block an operation needs comes from the head of the free queue; only when that is
  empty does it come from the head of the cached free queue (least recently freed first),
  and its cached prefix is evicted;
- ``release`` drops one reference from each of a request's blocks, last block first; a
  block left with none goes to the tail of the cached free queue if it holds a cached
  prefix, else to the tail of the free queue.

KV cache groups (vLLM v1's word): ``group_windows`` lists their kinds (``spec.kinds``):
``FullAttention()`` (shorthand ``None``), ``SlidingWindow(W)`` (shorthand W) or
``RecurrentState(C)``. All groups share the one pool and its two queues; a request has
one table per group, all with the same ``token_count``, and every operation acts on all
of them, group 0 first, asking each group's kind where the groups' rules differ. The
default ``(None,)`` is the allocator without groups.

Errors (``spec.errors``; checked in the order each operation lists; a refused operation
changes nothing): ``TypeError`` for an argument of the wrong type; ``ValueError`` for bad
configuration, a negative count, a token id out of range, a duplicate request id or the
wrong kind of append; ``KeyError`` for an unknown request id; ``BlockAllocationError`` when
the free and cached free queues together hold fewer blocks than the operation needs.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from spec.errors import (
    check_group,
    check_host_tier,
    check_pool_shape,
    unknown_request,
)
from spec.events import KVCacheEvent
from spec.frozen_map import FrozenMap
from spec.host_tier import HostTier, host_free_blocks, init_host_tier, swapped_host_block_ids
from spec.kinds import FullAttention, GroupEntry, GroupKind, group_kinds
from spec.records import CacheKey, KVBlockUsage, RequestBlockTable

TokenIds = tuple[int, ...]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SharingCounters:
    """Running totals of the sharing machinery, for the usage report."""

    prefix_hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    preemptions: int = 0
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """The whole allocator: pool shape, both free queues, tables, references and the cache.

    ``group_tables[g]`` and ``group_caches[g]`` are KV cache group g's tables (by request
    id) and prefix cache (salt and whole prefix -> block); a block belongs to one group at a
    time. ``tables`` and ``cache`` read group 0's. ``token_ids`` holds the tokens of each
    request allocated by token ids (a request absent from it was allocated by count and is
    never cached); ``cache_salts`` the salt of each request that has one (a request absent
    from it caches under ``None``). ``pending_copies`` are the copy-on-write copies and
    ``pending_skipped_block_ids`` the blocks windows freed, both until ``take_transfers``;
    ``events`` the KV cache events emitted since the last ``take_events``; ``host`` the
    host tier (``spec.host_tier``).
    """

    block_size: int
    total_blocks: int
    free_block_ids: tuple[int, ...]
    group_tables: tuple[FrozenMap[str, RequestBlockTable], ...]
    cached_free_block_ids: tuple[int, ...]
    ref_counts: FrozenMap[int, int]
    token_ids: FrozenMap[str, TokenIds]
    group_caches: tuple[FrozenMap[CacheKey, int], ...]
    pending_copies: tuple[tuple[int, int], ...]
    counters: SharingCounters
    group_windows: tuple[GroupKind, ...] = (FullAttention(),)
    pending_skipped_block_ids: tuple[int, ...] = ()
    cache_salts: FrozenMap[str, str] = field(default_factory=FrozenMap[str, str])
    events: tuple[KVCacheEvent, ...] = ()
    host: HostTier = field(default_factory=HostTier)

    @property
    def tables(self) -> FrozenMap[str, RequestBlockTable]:
        """Group 0's tables: with the default single group, every table."""
        return self.group_tables[0]

    @property
    def cache(self) -> FrozenMap[CacheKey, int]:
        """Group 0's prefix cache: with the default single group, the whole cache."""
        return self.group_caches[0]


def init(
    total_blocks: int,
    block_size: int,
    group_windows: Sequence[GroupEntry] = (None,),
    host_blocks: int = 0,
    host_prefix_cache: bool = False,
) -> AllocatorState:
    """An empty pool of ``total_blocks`` blocks of ``block_size`` tokens, all free, in id order,
    shared by the KV cache groups ``group_windows`` (``None``: full attention; W: a window;
    ``RecurrentState``: a state group), and a host tier of ``host_blocks`` blocks
    (``spec.host_tier``), all free, in id order.

    Checks: both sizes ``int`` (TypeError), in [1, MAX_TOTAL_BLOCKS] and [1, MAX_BLOCK_SIZE]
    (ValueError); the host tier as ``spec.errors.check_host_tier`` says; ``group_windows``
    as ``spec.kinds.group_kinds`` says (held as their kinds).
    """
    check_pool_shape(total_blocks, block_size)
    check_host_tier(host_blocks, host_prefix_cache)
    windows = group_kinds(group_windows, block_size, host_blocks)
    return AllocatorState(
        block_size=block_size,
        total_blocks=total_blocks,
        free_block_ids=tuple(range(total_blocks)),
        group_tables=tuple(FrozenMap[str, RequestBlockTable]() for _ in windows),
        cached_free_block_ids=(),
        ref_counts=FrozenMap(),
        token_ids=FrozenMap(),
        group_caches=tuple(FrozenMap[CacheKey, int]() for _ in windows),
        pending_copies=(),
        counters=SharingCounters(),
        group_windows=windows,
        host=init_host_tier(host_blocks, host_prefix_cache, len(windows)),
    )


# -- queries ------------------------------------------------------------------------------


def snapshot_request(state: AllocatorState, request_id: str, group: int = 0) -> RequestBlockTable:
    """The table of ``request_id`` in KV cache group ``group``; ``KeyError`` if it holds no
    blocks here (after ``check_group``)."""
    table = state.group_tables[check_group(group, len(state.group_windows))].get(request_id)
    if table is None:
        unknown_request(request_id)
    return table


def get_tables(state: AllocatorState, request_id: str) -> tuple[RequestBlockTable, ...]:
    """The request's table in every group, group 0's first; ``KeyError`` if it holds no
    blocks here."""
    snapshot_request(state, request_id)
    return tuple(tables[request_id] for tables in state.group_tables)


def free_blocks(state: AllocatorState) -> int:
    """Blocks an allocation may take: the free queue plus the cached free queue."""
    return len(state.free_block_ids) + len(state.cached_free_block_ids)


def compute_skipped_blocks(state: AllocatorState, group: int, computed_tokens: int) -> int:
    """How many leading blocks of a table in ``group`` no query at a position at or past
    ``computed_tokens`` reads: max(0, computed_tokens - W + 1) // block_size, 0 in a full
    or a state group (the window rule of ``spec.growth``)."""
    return state.group_windows[group].skipped_blocks_at(state.block_size, computed_tokens)


def is_request_known(state: AllocatorState, request_id: str) -> bool:
    """Whether ``request_id`` is taken: it holds device blocks, or is swapped out."""
    return request_id in state.tables or request_id in state.host.swapped


def get_cache_salt(state: AllocatorState, request_id: str) -> str | None:
    """The salt ``request_id`` caches under (``None`` if it has none)."""
    return state.cache_salts.get(request_id)


def usage(state: AllocatorState) -> KVBlockUsage:
    """The usage report, computed from the tables, the queues and the cache."""
    free = free_blocks(state)
    used_blocks = state.total_blocks - free
    group_blocks = [
        {block_id for table in tables.values() for block_id in table.block_ids}
        for tables in state.group_tables
    ]
    every_table = [table for tables in state.group_tables for table in tables.values()]
    return KVBlockUsage(
        block_size=state.block_size,
        total_blocks=state.total_blocks,
        used_blocks=used_blocks,
        free_blocks=free,
        request_count=len(state.tables),
        allocated_tokens=sum(table.token_count for table in state.tables.values()),
        reserved_tokens=used_blocks * state.block_size,
        cached_blocks=sum(len(cache) for cache in state.group_caches),
        shared_blocks=sum(1 for count in state.ref_counts.values() if count > 1),
        prefix_hit_tokens=state.counters.prefix_hit_tokens,
        evictions=state.counters.evictions,
        cow_copies=state.counters.cow_copies,
        preemptions=state.counters.preemptions,
        group_reserved_tokens=tuple(len(blocks) * state.block_size for blocks in group_blocks),
        skipped_blocks=state.counters.skipped_blocks,
        host_blocks=state.host.host_blocks,
        host_free_blocks=host_free_blocks(state.host),
        host_swapped_blocks=len(swapped_host_block_ids(state.host)),
        host_cached_blocks=len(state.host.host_cached_block_ids),
        swapped_requests=len(state.host.swapped),
        swapped_out_blocks=state.host.counters.swapped_out_blocks,
        swapped_in_blocks=state.host.counters.swapped_in_blocks,
        host_hit_blocks=state.host.counters.host_hit_blocks,
        cached_free_blocks=len(state.cached_free_block_ids),
        table_blocks=sum(len(table.block_ids) for table in every_table),
        table_skipped_blocks=sum(table.skipped_blocks for table in every_table),
    )


# -- building a new state ---------------------------------------------------------------


def with_item(items: tuple[T, ...], index: int, item: T) -> tuple[T, ...]:
    """``items`` with the one at ``index`` replaced by ``item``."""
    return (*items[:index], item, *items[index + 1 :])


def emit(state: AllocatorState, *events: KVCacheEvent) -> AllocatorState:
    """``state`` with ``events`` after the ones it emitted so far."""
    return replace(state, events=state.events + events)


def set_group_tables(
    state: AllocatorState, group: int, tables: FrozenMap[str, RequestBlockTable]
) -> AllocatorState:
    return replace(state, group_tables=with_item(state.group_tables, group, tables))


def set_table(state: AllocatorState, group: int, table: RequestBlockTable) -> AllocatorState:
    tables = state.group_tables[group].set(table.request_id, table)
    return set_group_tables(state, group, tables)


def set_cache(state: AllocatorState, group: int, cache: FrozenMap[CacheKey, int]) -> AllocatorState:
    return replace(state, group_caches=with_item(state.group_caches, group, cache))


def forget_request(state: AllocatorState, request_id: str) -> AllocatorState:
    """``state`` without the tokens and salt of ``request_id`` (its tables are the caller's)."""
    if request_id in state.token_ids:
        state = replace(state, token_ids=state.token_ids.delete(request_id))
    if request_id in state.cache_salts:
        state = replace(state, cache_salts=state.cache_salts.delete(request_id))
    return state
