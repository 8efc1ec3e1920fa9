"""The executable specification of the paged KV block allocator, with sharing.

Frozen data and pure functions: every operation takes a state and returns a new one,
never touching its argument. This is the definition of correct behaviour, written to be
read, not to be fast (impl/ is the fast one and is tested against this module).

Block order is part of the contract, so that impl can be compared with it exactly:
- ``init`` lays the free queue out as 0, 1, ..., total_blocks - 1;
- a block an operation needs comes from the head of the free queue; only when that is
  empty does it come from the head of the cached free queue (least recently freed first),
  and its cached prefix is evicted;
- ``release`` drops one reference from each of a request's blocks, last block first; a
  block left with none goes to the tail of the cached free queue if it holds a cached
  prefix, else to the tail of the free queue.

Sharing. A block may sit in several tables: a full block whose tokens are a prefix that
two prompts share (prefix caching), or any block after ``fork``. ``ref_counts`` counts the
tables holding each block. The prefix cache maps a ``CacheKey`` (a cache salt and a prompt
prefix that ends on a block boundary) to the block holding its last ``block_size`` tokens.
Keys are whole prefixes, so a hit is confirmed by comparing token ids, never a hash.

Cache salts (tenants). ``allocate_prompt`` takes a ``cache_salt`` (``None``: no salt, a
namespace of its own); a request finds hits only among blocks cached under its own salt,
and caches the blocks it fills under it. ``fork`` gives the child its parent's salt: a
fork is the same tenant's continuation (parallel samples, beams), and there is no fork
into another salt. So a table holds a cached block only if it is cached under the
table's salt (``spec.invariants.is_salt_isolated``). Appending into a shared, partly
filled last block copies it first (copy-on-write): the writer gets a fresh block and the
(source, destination) pair joins ``pending_copies`` for the KV pool to perform.

KV cache groups and sliding windows. ``group_windows`` lists the pool's KV cache groups
(vLLM v1's word): ``None`` for a group of full-attention layers, W for a group of layers
with a sliding window of W tokens (the query at position q reads keys q - W + 1 .. q).
All groups share the one pool and its two queues; a request has one table per group,
all with the same ``token_count``, and every operation acts on all of them, group 0
first. The default ``(None,)`` is the allocator without groups.

- The window rule. An operation that adds tokens to a request whose first L0 tokens are
  computed (``append_*``: L0 = its length before; ``allocate``: 0; ``allocate_prompt``:
  the cached tokens of its hit) first releases, in every group with window W, each block
  b with (b + 1) * block_size <= L0 - W + 1: no query at a position >= L0 reads any of
  its keys. So ``skipped_blocks`` becomes max(0, L0 - W + 1) // block_size (vLLM's
  ``SlidingWindowManager.remove_skipped_blocks`` with ``num_computed_tokens`` = L0). The
  blocks go where ``release`` sends a block, in block index order, group by group,
  before the operation takes a block; those that became free and uncached wait in
  ``pending_skipped_block_ids`` until ``take_skipped_blocks`` (the KV pool poisons
  them), and leave it if an allocation takes them first. The rule applies at every call
  of an adding operation, with zero tokens too.
- The hit rule. A prompt hit of h tokens (a multiple of block_size, at most
  len(prompt) - 1) needs, in every full group, the cached blocks of all of [0, h), and
  in a group with window W only those covering [max(0, h - W + 1), h): the window rule
  at L0 = h skips the blocks before, so they are born skipped. ``allocate_prompt`` takes
  the largest such h (vLLM's ``find_longest_cache_hit``: a sliding-window group needs
  ceil((W - 1) / block_size) contiguous cached blocks ending at the hit).

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
    BlockAllocationError,
    allocated_by_count,
    check_cache_salt,
    check_group,
    check_group_windows,
    check_host_tier,
    check_pool_shape,
    check_request_id,
    check_token_count,
    check_token_ids,
    check_truncate,
    duplicate_request,
    tracks_token_ids,
    unknown_request,
)
from spec.frozen_map import FrozenMap
from spec.host_tier import (
    HostTier,
    busy_block_ids,
    host_free_blocks,
    init_host_tier,
    release_host_blocks,
    swapped_host_block_ids,
    take_host_blocks,
)
from spec.records import CacheKey, KVBlockUsage, RequestBlockTable
from spec.rules import (
    blocks_for_request,
    blocks_for_tokens,
    first_window_token,
    skipped_blocks_at,
)

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
    time. ``tables`` and ``cache`` read group 0's. ``cache_salts`` holds the salt of each
    request that has one (a request absent from it caches under ``None``).
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
    group_windows: tuple[int | None, ...] = (None,)
    pending_skipped_block_ids: tuple[int, ...] = ()
    cache_salts: FrozenMap[str, str] = field(default_factory=FrozenMap[str, str])
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
    group_windows: Sequence[int | None] = (None,),
    host_blocks: int = 0,
    host_prefix_cache: bool = False,
) -> AllocatorState:
    """An empty pool of ``total_blocks`` blocks of ``block_size`` tokens, all free, in id order,
    shared by the KV cache groups ``group_windows`` (``None``: full attention; W: a window),
    and a host tier of ``host_blocks`` blocks (``spec.host_tier``), all free, in id order.

    Checks: both sizes ``int`` (TypeError), in [1, MAX_TOTAL_BLOCKS] and [1, MAX_BLOCK_SIZE]
    (ValueError); ``group_windows`` as ``spec.errors.check_group_windows`` says; the host
    tier as ``spec.errors.check_host_tier`` says.
    """
    check_pool_shape(total_blocks, block_size)
    windows = check_group_windows(group_windows)
    check_host_tier(host_blocks, host_prefix_cache)
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


# -- queries ----------------------------------------------------------------------------


def snapshot_request(state: AllocatorState, request_id: str, group: int = 0) -> RequestBlockTable:
    """The table of ``request_id`` in KV cache group ``group``; ``KeyError`` if it holds no
    blocks here (after ``check_group``)."""
    table = state.group_tables[check_group(group, len(state.group_windows))].get(request_id)
    if table is None:
        unknown_request(request_id)
    return table


def free_blocks(state: AllocatorState) -> int:
    """Blocks an allocation may take: the free queue plus the cached free queue."""
    return len(state.free_block_ids) + len(state.cached_free_block_ids)


def compute_skipped_blocks(state: AllocatorState, group: int, computed_tokens: int) -> int:
    """How many leading blocks of a table in ``group`` no query at a position at or past
    ``computed_tokens`` reads: max(0, computed_tokens - W + 1) // block_size, 0 in a full
    group (the window rule of the module docstring)."""
    return skipped_blocks_at(state.block_size, computed_tokens, state.group_windows[group])


def is_request_known(state: AllocatorState, request_id: str) -> bool:
    """Whether ``request_id`` is taken: it holds device blocks, or is swapped out."""
    return request_id in state.tables or request_id in state.host.swapped


def get_cache_salt(state: AllocatorState, request_id: str) -> str | None:
    """The salt ``request_id`` caches under (``None`` if it has none)."""
    return state.cache_salts.get(request_id)


def is_hit_cached(
    state: AllocatorState,
    group: int,
    token_ids: TokenIds,
    hit_tokens: int,
    cache_salt: str | None = None,
) -> bool:
    """Whether ``group`` caches, under ``cache_salt``, every block a hit of ``hit_tokens``
    tokens needs there (on the device or the host: ``is_key_cached``): the blocks from
    ``compute_skipped_blocks(hit_tokens)`` up to ``hit_tokens``."""
    block_size = state.block_size
    first = compute_skipped_blocks(state, group, hit_tokens)
    return all(
        is_key_cached(state, group, CacheKey(cache_salt, token_ids[: (index + 1) * block_size]))
        for index in range(first, hit_tokens // block_size)
    )


def is_key_cached(state: AllocatorState, group: int, key: CacheKey) -> bool:
    """Whether ``group`` caches ``key`` on the device or, with the host prefix cache, on
    the host (a demoted prefix a hit brings back)."""
    if key in state.group_caches[group]:
        return True
    return state.host.host_prefix_cache and key in state.host.host_caches[group]


def cached_prefix_tokens(
    state: AllocatorState, token_ids: TokenIds, cache_salt: str | None = None
) -> int:
    """The hit rule: the largest multiple h of block_size, at most len(token_ids) - 1, that
    every group caches under ``cache_salt`` (``is_hit_cached``); 0 if none. The last token
    is never a hit, so that at least one token of a prompt is computed."""
    block_size = state.block_size
    longest = (len(token_ids) - 1) // block_size * block_size
    for hit_tokens in range(longest, 0, -block_size):
        groups = range(len(state.group_windows))
        if all(is_hit_cached(state, g, token_ids, hit_tokens, cache_salt) for g in groups):
            return hit_tokens
    return 0


def cached_prefix_blocks(
    state: AllocatorState, token_ids: TokenIds, group: int = 0, cache_salt: str | None = None
) -> tuple[int, ...]:
    """The cached device blocks a prompt of ``token_ids`` under ``cache_salt`` would reuse
    in ``group``: those of the hit of ``cached_prefix_tokens`` tokens that are not born
    skipped and are cached on the device, in index order."""
    cache = state.group_caches[group]
    return tuple(
        cache[key] for key in _hit_keys(state, token_ids, group, cache_salt) if key in cache
    )


def host_prefix_hits(
    state: AllocatorState, token_ids: TokenIds, group: int = 0, cache_salt: str | None = None
) -> tuple[tuple[int, int], ...]:
    """The blocks of that hit that ``group`` caches on the host only: (index among the
    hit's blocks, host block), in index order. Each takes a device block and a
    (host -> device) copy."""
    cache = state.group_caches[group]
    host_cache = state.host.host_caches[group] if state.host.host_caches else FrozenMap()
    return tuple(
        (index, host_cache[key])
        for index, key in enumerate(_hit_keys(state, token_ids, group, cache_salt))
        if key not in cache
    )


def _hit_keys(
    state: AllocatorState, token_ids: TokenIds, group: int, cache_salt: str | None
) -> list[CacheKey]:
    """The keys of the blocks a hit needs in ``group``, in index order."""
    hit_tokens = cached_prefix_tokens(state, token_ids, cache_salt)
    block_size = state.block_size
    first = compute_skipped_blocks(state, group, hit_tokens)
    return [
        CacheKey(cache_salt, token_ids[: (index + 1) * block_size])
        for index in range(first, hit_tokens // block_size)
    ]


def usage(state: AllocatorState) -> KVBlockUsage:
    """The usage report, computed from the tables, the queues and the cache."""
    free = free_blocks(state)
    used_blocks = state.total_blocks - free
    group_blocks = [
        {block_id for table in tables.values() for block_id in table.block_ids}
        for tables in state.group_tables
    ]
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
    )


# -- transitions --------------------------------------------------------------------------


def allocate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Give a new request blocks for ``token_count`` tokens whose ids are not tracked, in
    every group (group 0's first); nothing is computed yet, so nothing is skipped.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a ``str`` request id
    (TypeError) that is new (ValueError), enough blocks (BlockAllocationError). Its blocks
    are never cached.
    """
    per_group = blocks_for_tokens(state.block_size, token_count)
    needed = blocks_for_request(state.block_size, token_count, len(state.group_windows))
    check_request_id(request_id)
    if is_request_known(state, request_id):
        duplicate_request(request_id)
    if needed > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, needed, free_blocks(state))
    for group in range(len(state.group_windows)):
        state, taken = _take_blocks(state, per_group)
        state = _set_table(state, group, RequestBlockTable(request_id, taken, token_count))
    return state


def allocate_prompt(
    state: AllocatorState, request_id: str, token_ids: TokenIds, cache_salt: str | None = None
) -> AllocatorState:
    """Give a new request blocks for its prompt, reusing the longest prefix cached under
    its ``cache_salt``.

    Checks: a ``str`` request id (TypeError) that is new (ValueError), token ids that are
    ``int`` (TypeError) in [0, MAX_TOKEN_ID] (ValueError), a ``str`` or ``None`` salt
    (TypeError), enough blocks beyond the cache hits (BlockAllocationError). The hit is
    ``cached_prefix_tokens(state, token_ids, cache_salt)`` of the state before; in each
    group its ``cached_prefix_blocks`` gain a reference (a cached free block is revived),
    the blocks before them are born skipped; then, group by group (group 0's first), each
    of its ``host_prefix_hits`` takes a device block from the queues, cached again on the
    device under its key, with a (host -> device) copy (the host keeps its copy), and the
    blocks past the hit come from the queues; every block the prompt fills is cached
    under ``cache_salt``.
    """
    check_request_id(request_id)
    if is_request_known(state, request_id):
        duplicate_request(request_id)
    check_token_ids(token_ids)
    check_cache_salt(cache_salt)
    groups = range(len(state.group_windows))
    hit_tokens = cached_prefix_tokens(state, token_ids, cache_salt)
    hits = [cached_prefix_blocks(state, token_ids, group, cache_salt) for group in groups]
    host_hits = [host_prefix_hits(state, token_ids, group, cache_salt) for group in groups]
    hit_keys = [_hit_keys(state, token_ids, group, cache_salt) for group in groups]
    per_group = blocks_for_tokens(state.block_size, len(token_ids)) - hit_tokens // state.block_size
    needed = per_group * len(groups) + sum(len(group_hits) for group_hits in host_hits)
    revived = [b for group_hits in hits for b in group_hits if b in state.cached_free_block_ids]
    available = free_blocks(state) - len(revived)
    if needed > available:
        raise BlockAllocationError.out_of_blocks(request_id, needed, available)
    state = replace(
        state,
        cached_free_block_ids=tuple(
            block_id for block_id in state.cached_free_block_ids if block_id not in revived
        ),
        ref_counts=_add_references(state.ref_counts, tuple(b for h in hits for b in h)),
        counters=replace(
            state.counters, prefix_hit_tokens=state.counters.prefix_hit_tokens + hit_tokens
        ),
        host=_hold_in_flight(state.host, {b for h in hits for b in h}),
    )
    for group in groups:
        state, from_host = _take_blocks(state, len(host_hits[group]))
        state = _revive_from_host(state, group, host_hits[group], from_host, hit_keys[group])
        state, taken = _take_blocks(state, per_group)
        device_hits = iter(hits[group])
        revived_from_host = dict(zip((i for i, _ in host_hits[group]), from_host, strict=True))
        held = tuple(
            revived_from_host[index] if index in revived_from_host else next(device_hits)
            for index in range(len(hit_keys[group]))
        )
        skipped = compute_skipped_blocks(state, group, hit_tokens)
        table = RequestBlockTable(request_id, held + taken, len(token_ids), skipped)
        state = _set_table(state, group, table)
    state = replace(state, token_ids=state.token_ids.set(request_id, tuple(token_ids)))
    if cache_salt is not None:
        state = replace(state, cache_salts=state.cache_salts.set(request_id, cache_salt))
    return _cache_full_blocks(state, request_id, first_index=hit_tokens // state.block_size)


def append_tokens(state: AllocatorState, request_id: str, token_count: int = 1) -> AllocatorState:
    """Grow a request allocated by count by ``token_count`` tokens, taking blocks as needed.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a known request
    (KeyError), a request allocated by count, not by token ids (ValueError), enough blocks
    (BlockAllocationError).
    """
    check_token_count(token_count)
    snapshot_request(state, request_id)
    if request_id in state.token_ids:
        tracks_token_ids(request_id)
    return _grow(state, request_id, token_count)


def append_token_ids(state: AllocatorState, request_id: str, token_ids: TokenIds) -> AllocatorState:
    """Grow a request allocated by ``allocate_prompt`` by these tokens; full blocks get cached.

    Checks: a known request (KeyError), a request that tracks token ids (ValueError), token
    ids that are ``int`` (TypeError) in [0, MAX_TOKEN_ID] (ValueError), enough blocks
    (BlockAllocationError).
    """
    snapshot_request(state, request_id)
    if request_id not in state.token_ids:
        allocated_by_count(request_id)
    check_token_ids(token_ids)
    state = _grow(state, request_id, len(token_ids))
    old_ids = state.token_ids[request_id]
    state = replace(state, token_ids=state.token_ids.set(request_id, old_ids + tuple(token_ids)))
    return _cache_full_blocks(state, request_id, first_index=len(old_ids) // state.block_size)


def fork(state: AllocatorState, parent_id: str, child_id: str) -> AllocatorState:
    """Give ``child_id`` a table sharing every block of ``parent_id`` in every group (one more
    reference each, group 0's first), with the parent's ``skipped_blocks`` and cache salt
    (a fork stays in its parent's namespace: there is no fork across salts).

    Checks: a known parent (KeyError), a ``str`` child id (TypeError) that is new
    (ValueError). Takes no block.
    """
    snapshot_request(state, parent_id)
    check_request_id(child_id)
    if is_request_known(state, child_id):
        duplicate_request(child_id)
    for group, tables in enumerate(state.group_tables):
        parent = tables[parent_id]
        state = _set_table(state, group, replace(parent, request_id=child_id))
        state = replace(state, ref_counts=_add_references(state.ref_counts, parent.block_ids))
    if parent_id in state.token_ids:
        state = replace(state, token_ids=state.token_ids.set(child_id, state.token_ids[parent_id]))
    if parent_id in state.cache_salts:
        salt = state.cache_salts[parent_id]
        state = replace(state, cache_salts=state.cache_salts.set(child_id, salt))
    return state


def release(state: AllocatorState, request_id: str) -> AllocatorState:
    """Drop a request: each of its blocks loses a reference, group by group, last block first.

    Checks: a known request (KeyError). A block left with no reference joins the tail of the
    cached free queue if it holds a cached prefix (it stays findable), else of the free
    queue; a pending copy into it is dropped. The ids released, in table order, are the
    group tables' ``block_ids``, group 0's first.

    A swapped-out request holds no device block: its host blocks join the host free
    queue's tail, group by group, last block first; a pending copy into one is dropped
    (its device block, in flight, goes where this release would have sent it).
    """
    if request_id in state.host.swapped:
        return _release_swapped(state, request_id)
    snapshot_request(state, request_id)
    for group, tables in enumerate(state.group_tables):
        state = _drop_references(state, tables[request_id].block_ids)
        state = _set_group_tables(state, group, state.group_tables[group].delete(request_id))
    if request_id in state.token_ids:
        state = replace(state, token_ids=state.token_ids.delete(request_id))
    if request_id in state.cache_salts:
        state = replace(state, cache_salts=state.cache_salts.delete(request_id))
    return state


def truncate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Shrink a request to its first ``token_count`` tokens: the rollback of rejected
    speculative tokens.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a known request
    (KeyError), ``token_count`` at most the request's tokens (ValueError), and no group
    with window W that skipped a block the shorter request would read again, i.e. with
    ``skipped_blocks * block_size > max(0, token_count - W + 1)`` (ValueError): its K/V is
    gone. In each group the blocks wholly beyond the new length are dropped as ``release``
    drops a table's blocks (last first, to the tails of the queues). If the new last block
    is partly filled and was a cached full block, it stops being cached, whoever holds it:
    its slots past the new length will be written again (in place, or in a copy if it is
    shared: the next append copies a shared partly filled block). Tokens past the new
    length are forgotten.
    """
    check_token_count(token_count)
    table = snapshot_request(state, request_id)
    check_truncate(
        request_id,
        token_count,
        table.token_count,
        block_size=state.block_size,
        group_windows=state.group_windows,
        skipped_blocks=[tables[request_id].skipped_blocks for tables in state.group_tables],
        first_reads=[first_window_token(token_count, window) for window in state.group_windows],
    )
    keep = blocks_for_tokens(state.block_size, token_count)
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        held = keep - table.skipped_blocks
        state = _drop_references(state, table.block_ids[held:])
        kept = table.block_ids[:held]
        cache = state.group_caches[group]
        if token_count % state.block_size and kept[-1] in cache.values():
            cache = FrozenMap({key: b for key, b in cache.items() if b != kept[-1]})
        state = _set_cache(state, group, cache)
        state = _set_table(state, group, replace(table, block_ids=kept, token_count=token_count))
    if request_id in state.token_ids:
        ids = state.token_ids[request_id][:token_count]
        state = replace(state, token_ids=state.token_ids.set(request_id, ids))
    return state


def preempt(state: AllocatorState, request_id: str) -> AllocatorState:
    """Release a request the engine preempts to recompute later; counts the preemption."""
    state = release(state, request_id)
    counters = replace(state.counters, preemptions=state.counters.preemptions + 1)
    return replace(state, counters=counters)


def reset_prefix_cache(state: AllocatorState) -> AllocatorState:
    """Forget every cached prefix, in every group: the cached free blocks join the tail of
    the free queue as plain free blocks (least recently freed first, their queue order),
    and the blocks tables hold keep their K/V but lose their keys, so no later prompt hits
    them. Blocks the tables fill later are cached again as usual. Never refused.

    The host prefix cache forgets its keys too: its blocks join the host free queue's
    tail in their order (least recently used first), but one a pending copy in reads,
    which waits for ``take_swap_copies``; a copy out into one is dropped and its device
    block lands, uncached."""
    state = replace(
        state,
        free_block_ids=state.free_block_ids + state.cached_free_block_ids,
        cached_free_block_ids=(),
        group_caches=tuple(FrozenMap[CacheKey, int]() for _ in state.group_caches),
    )
    host = state.host
    if not host.host_cached_block_ids:
        return state
    copying_in = {h for h, _ in host.pending_host_to_device}
    host = release_host_blocks(
        replace(
            host,
            host_caches=tuple(FrozenMap[CacheKey, int]() for _ in host.host_caches),
            host_cached_block_ids=(),
        ),
        (h for h in host.host_cached_block_ids if h not in copying_in),
    )
    return _with_host(state, host)


def take_copies(state: AllocatorState) -> AllocatorState:
    """Clear ``pending_copies`` once the KV pool has performed them (they are read before)."""
    return replace(state, pending_copies=())


def take_skipped_blocks(state: AllocatorState) -> AllocatorState:
    """Clear ``pending_skipped_block_ids`` once the KV pool has poisoned them (read before)."""
    return replace(state, pending_skipped_block_ids=())


# -- building blocks ----------------------------------------------------------------------


def _with_item(items: tuple[T, ...], index: int, item: T) -> tuple[T, ...]:
    """``items`` with the one at ``index`` replaced by ``item``."""
    return (*items[:index], item, *items[index + 1 :])


def _set_group_tables(
    state: AllocatorState, group: int, tables: FrozenMap[str, RequestBlockTable]
) -> AllocatorState:
    return replace(state, group_tables=_with_item(state.group_tables, group, tables))


def _set_table(state: AllocatorState, group: int, table: RequestBlockTable) -> AllocatorState:
    tables = state.group_tables[group].set(table.request_id, table)
    return _set_group_tables(state, group, tables)


def _set_cache(
    state: AllocatorState, group: int, cache: FrozenMap[CacheKey, int]
) -> AllocatorState:
    return replace(state, group_caches=_with_item(state.group_caches, group, cache))


def _add_references(
    ref_counts: FrozenMap[int, int], block_ids: tuple[int, ...]
) -> FrozenMap[int, int]:
    counts = dict(ref_counts)
    for block_id in block_ids:
        counts[block_id] = counts.get(block_id, 0) + 1
    return FrozenMap(counts)


def _drop_references(state: AllocatorState, block_ids: tuple[int, ...]) -> AllocatorState:
    """Drop one reference from each of ``block_ids``, last first (``_release_in_order``)."""
    return _release_in_order(state, tuple(reversed(block_ids)))


def _release_in_order(
    state: AllocatorState, block_ids: tuple[int, ...], *, demote: bool = True
) -> AllocatorState:
    """Drop one reference from each of ``block_ids`` in the order given; a block left with
    none joins the tail of the cached free queue if it holds a cached prefix, else of the
    free queue, unless a pending copy between the tiers reads or writes it: then it is in
    flight (``spec.host_tier``) and joins a queue when ``take_swap_copies`` hands that copy
    over. With the host prefix cache, a cached block left with none gets a host copy
    (``_demote``) and is in flight too, unless ``demote`` is off (a window's skips). A
    pending copy-on-write copy into a block that became free is moot and is dropped, so a
    pending copy never writes into a block that is free or lent to another request."""
    cached = {block_id for cache in state.group_caches for block_id in cache.values()}
    busy = busy_block_ids(state.host)
    ref_counts = dict(state.ref_counts)
    freed: list[int] = []
    freed_cached: list[int] = []
    flown: list[int] = []
    for block_id in block_ids:
        ref_counts[block_id] -= 1
        if ref_counts[block_id] == 0:
            del ref_counts[block_id]
            if block_id in busy:
                flown.append(block_id)
            elif block_id not in cached:
                freed.append(block_id)
            elif demote and state.host.host_prefix_cache and _can_demote(state, block_id):
                state = _demote(state, block_id)
                flown.append(block_id)
            else:
                freed_cached.append(block_id)
    state = replace(
        state,
        free_block_ids=state.free_block_ids + tuple(freed),
        cached_free_block_ids=state.cached_free_block_ids + tuple(freed_cached),
        ref_counts=FrozenMap(ref_counts),
        pending_copies=tuple(
            (source, destination)
            for source, destination in state.pending_copies
            if destination in ref_counts
        ),
    )
    if not flown:
        return state
    flying = state.host.in_flight_block_ids + tuple(flown)
    return replace(state, host=replace(state.host, in_flight_block_ids=flying))


def _cache_key_of(state: AllocatorState, block_id: int) -> tuple[int, CacheKey]:
    """The group caching ``block_id`` and its key (the block is cached)."""
    for group, cache in enumerate(state.group_caches):
        for key, cached_block in cache.items():
            if cached_block == block_id:
                return group, key
    raise AssertionError(f"block {block_id} is not cached")


def _can_demote(state: AllocatorState, block_id: int) -> bool:
    """Whether a cached block left unreferenced gets a host copy: its key is not on the host
    yet and the host tier has a block for it (free, or an evictable host-cached one)."""
    group, key = _cache_key_of(state, block_id)
    return key not in state.host.host_caches[group] and host_free_blocks(state.host) > 0


def _demote(state: AllocatorState, block_id: int) -> AllocatorState:
    """Write-through at free time: a host block for the cached ``block_id`` (the host free
    queue's head, else the least recently used evictable host-cached block), its key on
    the host as the most recently used, and a (device -> host) copy, so the block goes in
    flight until the copy is taken (its K/V is whole now; a copy taken at eviction could
    not precede the evicting allocation's writes)."""
    group, key = _cache_key_of(state, block_id)
    host, (host_id,) = take_host_blocks(state.host, 1)
    host = replace(
        host,
        host_caches=tuple(
            cache.set(key, host_id) if g == group else cache
            for g, cache in enumerate(host.host_caches)
        ),
        host_cached_block_ids=(*host.host_cached_block_ids, host_id),
        pending_device_to_host=(*host.pending_device_to_host, (block_id, host_id)),
    )
    return replace(state, host=host)


def _release_swapped(state: AllocatorState, request_id: str) -> AllocatorState:
    """``release`` of a swapped-out request: its host blocks join the host free queue's tail
    (group by group, last block first)."""
    swapped = state.host.swapped[request_id]
    host = release_host_blocks(
        replace(state.host, swapped=state.host.swapped.delete(request_id)),
        (b for group in swapped.group_host_block_ids for b in reversed(group)),
    )
    return _with_host(state, host)


def _with_host(state: AllocatorState, host: HostTier) -> AllocatorState:
    """``state`` with the host tier ``host``, which may have dropped pending copies out: an
    in-flight block no copy reads any more joins a queue's tail as ``release`` sends a
    block there, in the order it went in flight."""
    busy = busy_block_ids(host)
    landed = [b for b in host.in_flight_block_ids if b not in busy]
    if landed:
        flying = tuple(b for b in host.in_flight_block_ids if b in busy)
        host = replace(host, in_flight_block_ids=flying)
    return _queue_unreferenced(replace(state, host=host), landed)


def _revive_from_host(
    state: AllocatorState,
    group: int,
    host_hits: tuple[tuple[int, int], ...],
    device_ids: tuple[int, ...],
    hit_keys: list[CacheKey],
) -> AllocatorState:
    """A prefix hit on keys ``group`` caches on the host only: each gets its device block
    (``device_ids``, in order), cached on the device again, with a (host -> device) copy;
    its host block becomes the most recently used."""
    if not host_hits:
        return state
    cache = state.group_caches[group]
    for (index, _), device_id in zip(host_hits, device_ids, strict=True):
        cache = cache.set(hit_keys[index], device_id)
    used = {host_id for _, host_id in host_hits}
    host = state.host
    host = replace(
        host,
        pending_host_to_device=host.pending_host_to_device
        + tuple((h, d) for (_, h), d in zip(host_hits, device_ids, strict=True)),
        host_cached_block_ids=tuple(h for h in host.host_cached_block_ids if h not in used)
        + tuple(h for _, h in host_hits),
        counters=replace(
            host.counters, host_hit_blocks=host.counters.host_hit_blocks + len(host_hits)
        ),
    )
    return _set_cache(replace(state, host=host), group, cache)


def _hold_in_flight(host: HostTier, block_ids: set[int]) -> HostTier:
    """``host`` with these blocks (prefix hits, held again) no longer in flight: a hit may
    revive an in-flight cached block, whose K/V a copy out only reads."""
    if not block_ids & set(host.in_flight_block_ids):
        return host
    flying = tuple(b for b in host.in_flight_block_ids if b not in block_ids)
    return replace(host, in_flight_block_ids=flying)


def _queue_unreferenced(state: AllocatorState, block_ids: Sequence[int]) -> AllocatorState:
    """Put unreferenced blocks no copy reads any more at the queues' tails, in order: the
    cached free queue if a group caches them, else the free queue."""
    cached = {block_id for cache in state.group_caches for block_id in cache.values()}
    return replace(
        state,
        free_block_ids=state.free_block_ids + tuple(b for b in block_ids if b not in cached),
        cached_free_block_ids=state.cached_free_block_ids
        + tuple(b for b in block_ids if b in cached),
    )


def _take_blocks(state: AllocatorState, count: int) -> tuple[AllocatorState, tuple[int, ...]]:
    """Take ``count`` blocks (one reference each): the free queue first, then evict cached
    ones (from whichever group's cache holds them). A taken block is no longer pending as
    skipped: it is not free any more."""
    from_free = state.free_block_ids[:count]
    evicted = state.cached_free_block_ids[: count - len(from_free)]
    taken = from_free + evicted
    return replace(
        state,
        free_block_ids=state.free_block_ids[len(from_free) :],
        cached_free_block_ids=state.cached_free_block_ids[len(evicted) :],
        group_caches=tuple(
            FrozenMap({key: b for key, b in cache.items() if b not in evicted})
            for cache in state.group_caches
        ),
        ref_counts=_add_references(state.ref_counts, taken),
        counters=replace(state.counters, evictions=state.counters.evictions + len(evicted)),
        pending_skipped_block_ids=tuple(
            block_id for block_id in state.pending_skipped_block_ids if block_id not in taken
        ),
    ), taken


def _skip_out_of_window(
    state: AllocatorState, request_id: str, computed_tokens: int
) -> AllocatorState:
    """The window rule: in each windowed group, release the table's leading blocks that no
    query at a position at or past ``computed_tokens`` reads, in block index order."""
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        skipped = compute_skipped_blocks(state, group, computed_tokens)
        if skipped <= table.skipped_blocks:
            continue
        dropped = table.block_ids[: skipped - table.skipped_blocks]
        free_before = len(state.free_block_ids)
        # NOTE: not demoted to the host: the skip is part of an append whose refusal is
        # decided first, and it would then depend on the host tier's room too.
        state = _release_in_order(state, dropped, demote=False)
        counters = replace(
            state.counters, skipped_blocks=state.counters.skipped_blocks + len(dropped)
        )
        state = replace(
            state,
            counters=counters,
            pending_skipped_block_ids=state.pending_skipped_block_ids
            + state.free_block_ids[free_before:],
        )
        rest = table.block_ids[len(dropped) :]
        state = _set_table(state, group, replace(table, block_ids=rest, skipped_blocks=skipped))
    return state


def _grow(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Add ``token_count`` tokens to every group's table: skip what left the window first,
    then take each group's blocks (group 0's first), copying a shared partly filled last
    block before the new ones."""
    computed_tokens = snapshot_request(state, request_id).token_count
    state = _skip_out_of_window(state, request_id, computed_tokens)
    block_size = state.block_size
    new_token_count = computed_tokens + token_count
    copies: list[bool] = []
    needed: list[int] = []
    for tables in state.group_tables:
        table = tables[request_id]
        copy_on_write = (
            token_count > 0
            and computed_tokens % block_size != 0
            and state.ref_counts[table.block_ids[-1]] > 1
        )
        copies.append(copy_on_write)
        held = table.skipped_blocks + len(table.block_ids)
        needed.append(blocks_for_tokens(block_size, new_token_count) - held + copy_on_write)
    if sum(needed) > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, sum(needed), free_blocks(state))
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        state, taken = _take_blocks(state, needed[group])
        block_ids = table.block_ids
        if copies[group]:
            source, destination, taken = block_ids[-1], taken[0], taken[1:]
            block_ids = (*block_ids[:-1], destination)
            state = replace(
                state,
                ref_counts=state.ref_counts.set(source, state.ref_counts[source] - 1),
                pending_copies=(*state.pending_copies, (source, destination)),
                counters=replace(state.counters, cow_copies=state.counters.cow_copies + 1),
            )
        grown = replace(table, block_ids=block_ids + taken, token_count=new_token_count)
        state = _set_table(state, group, grown)
    return state


def _cache_full_blocks(state: AllocatorState, request_id: str, first_index: int) -> AllocatorState:
    """In each group, cache every full block the table holds from ``first_index`` on under
    the request's salt, unless that group caches that key already."""
    token_ids = state.token_ids[request_id]
    cache_salt = get_cache_salt(state, request_id)
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        cache = state.group_caches[group]
        start = max(first_index, table.skipped_blocks)
        for index in range(start, len(token_ids) // state.block_size):
            prefix = CacheKey(cache_salt, token_ids[: (index + 1) * state.block_size])
            if prefix not in cache:
                cache = cache.set(prefix, table.block_ids[index - table.skipped_blocks])
        state = _set_cache(state, group, cache)
    return state
