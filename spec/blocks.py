"""Where a block comes from and where it goes: the pool's rules every transition shares.

- A block an operation needs comes from the head of the free queue, then from the head
  of the cached free queue (least recently freed first), whose cached prefix is evicted
  (a ``BlockRemoved`` of the group that cached it); a pending demotion of an evicted block
  is moot and dropped (``take_blocks``).
- A reference dropped (``release_in_order``, in the order given) leaves a block with one
  fewer; a block left with none joins the tail of the cached free queue if a group caches
  it, else of the free queue, unless a pending copy between the tiers pins it: then it is
  in flight (the pending-copy rule of ``spec.host_tier``) and joins a queue when
  ``take_transfers`` hands that copy over. With the host prefix cache, the cached blocks a
  release leaves with none also get host copies (they are demoted: write-through at free
  time), as many as the host has room for, the last ones released first: a table releases
  its last block first, so the host keeps a chain's head, which every hit on the chain
  needs. They are copied head first, then they and those whose key the host has already
  become its most recently used in release order, the head newest. A demoted block still
  joins the cached free queue at once, where it would go without a host tier
  (the device behaves as if there were none). A pending copy-on-write copy into a block
  that became free is moot and is dropped, so a pending copy never writes into a block
  that is free or lent to another request.
- ``take_transfers`` hands over everything the KV pool must do with the pool's memory
  before the next forward, and clears it: every (device -> host) copy, every
  copy-on-write copy, every (host -> device) copy, in that order (a copy out reads a
  block before anything may overwrite it; a copy-on-write source freed meanwhile may be
  the destination of a copy in, so it is read before that copy writes it), then the
  blocks windows made free (their K/V is dead).
"""

from collections.abc import Sequence
from dataclasses import replace

from spec.events import BlockRemoved
from spec.frozen_map import FrozenMap
from spec.host_tier import (
    HostTier,
    drop_moot_demotion,
    host_free_blocks,
    pinned_block_ids,
    take_host_blocks,
)
from spec.records import CacheKey, Transfers
from spec.state import AllocatorState, emit


def take_blocks(state: AllocatorState, count: int) -> tuple[AllocatorState, tuple[int, ...]]:
    """Take ``count`` blocks (one reference each): the free queue first, then evict cached
    ones (from whichever group's cache holds them), dropping their pending demotions. A
    taken block is no longer pending as skipped: it is not free any more. The caller has
    checked there are enough."""
    from_free = state.free_block_ids[:count]
    evicted = state.cached_free_block_ids[: count - len(from_free)]
    taken = from_free + evicted
    removed = tuple(
        BlockRemoved(block_id, group)
        for block_id in evicted
        for group, cache in enumerate(state.group_caches)
        if block_id in cache.values()
    )
    state = emit(state, *removed)
    host = state.host
    for block_id in evicted:
        host = drop_moot_demotion(host, block_id)
    return replace(
        state,
        host=host,
        free_block_ids=state.free_block_ids[len(from_free) :],
        cached_free_block_ids=state.cached_free_block_ids[len(evicted) :],
        group_caches=tuple(
            FrozenMap({key: b for key, b in cache.items() if b not in evicted})
            for cache in state.group_caches
        ),
        ref_counts=add_references(state.ref_counts, taken),
        counters=replace(state.counters, evictions=state.counters.evictions + len(evicted)),
        pending_skipped_block_ids=tuple(
            block_id for block_id in state.pending_skipped_block_ids if block_id not in taken
        ),
    ), taken


def add_references(
    ref_counts: FrozenMap[int, int], block_ids: tuple[int, ...]
) -> FrozenMap[int, int]:
    """``ref_counts`` with one more reference to each of ``block_ids``."""
    counts = dict(ref_counts)
    for block_id in block_ids:
        counts[block_id] = counts.get(block_id, 0) + 1
    return FrozenMap(counts)


def drop_references(state: AllocatorState, block_ids: tuple[int, ...]) -> AllocatorState:
    """Drop one reference from each of a table's ``block_ids``, last first."""
    return release_in_order(state, tuple(reversed(block_ids)))


def release_in_order(
    state: AllocatorState, block_ids: tuple[int, ...], *, demote: bool = True
) -> AllocatorState:
    """Drop one reference from each of ``block_ids`` in the order given (the module's
    rule); ``demote`` off (a window's skips) never demotes."""
    cached = {block_id for cache in state.group_caches for block_id in cache.values()}
    pinned = pinned_block_ids(state.host)
    ref_counts = dict(state.ref_counts)
    freed: list[int] = []
    freed_cached: list[int] = []
    in_flight: list[int] = []
    for block_id in block_ids:
        ref_counts[block_id] -= 1
        if ref_counts[block_id] == 0:
            del ref_counts[block_id]
            if block_id in pinned:
                in_flight.append(block_id)
            elif block_id not in cached:
                freed.append(block_id)
            else:
                freed_cached.append(block_id)
    if demote and state.host.host_prefix_cache:
        state = _write_through(state, freed_cached)
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
    if not in_flight:
        return state
    flying = state.host.in_flight_block_ids + tuple(in_flight)
    return replace(state, host=replace(state.host, in_flight_block_ids=flying))


def _cache_key_of(state: AllocatorState, block_id: int) -> tuple[int, CacheKey]:
    """The group caching ``block_id`` and its key (the block is cached)."""
    for group, cache in enumerate(state.group_caches):
        for key, cached_block in cache.items():
            if cached_block == block_id:
                return group, key
    raise AssertionError(f"block {block_id} is not cached")


def _write_through(state: AllocatorState, block_ids: list[int]) -> AllocatorState:
    """The host prefix cache's part of a release (the module's rule) for the cached blocks
    it left unreferenced, ``block_ids`` in release order: those ``_demoted_head_first``
    chose are demoted, the chain's head first (so a copy's parent is on the host before
    it); then every key of theirs the host holds becomes its most recently used in release
    order (a release is a use: the host's LRU order is the order keys were last used, a
    chain's tail older than its head). The keys the host had already are made recent
    first too, so that the demotions take other host blocks before them."""
    on_host = _host_blocks_of(state, block_ids)
    state = _make_recent(state, on_host)
    for block_id in reversed(_demoted_head_first(state, block_ids)):
        state = _demote(state, block_id)
    return _make_recent(state, _host_blocks_of(state, block_ids))


def _host_blocks_of(state: AllocatorState, block_ids: list[int]) -> list[int]:
    """The host blocks caching the keys of these cached device blocks, in their order, for
    those the host caches."""
    found = []
    for block_id in block_ids:
        group, key = _cache_key_of(state, block_id)
        host_id = state.host.host_caches[group].get(key)
        if host_id is not None:
            found.append(host_id)
    return found


def _make_recent(state: AllocatorState, host_ids: list[int]) -> AllocatorState:
    """``state`` with these host-cached blocks the most recently used, in this order."""
    if not host_ids:
        return state
    moved = set(host_ids)
    kept = tuple(h for h in state.host.host_cached_block_ids if h not in moved)
    return replace(state, host=replace(state.host, host_cached_block_ids=(*kept, *host_ids)))


def _demoted_head_first(state: AllocatorState, block_ids: list[int]) -> list[int]:
    """Of cached blocks a release left unreferenced (in release order), those that get a
    host copy, in release order: the ones whose key the host lacks, the last released
    first, as many as the host has blocks for (free, or evictable host-cached ones). Each
    demotion takes one of those blocks and the new copy is not evictable, so the room
    counted first is the room there is."""
    demotable = [block_id for block_id in block_ids if not _is_on_host(state, block_id)]
    room = host_free_blocks(state.host)
    return demotable[max(0, len(demotable) - room) :]


def _is_on_host(state: AllocatorState, block_id: int) -> bool:
    """Whether the host caches the key of the cached ``block_id`` already."""
    group, key = _cache_key_of(state, block_id)
    return key in state.host.host_caches[group]


def _demote(state: AllocatorState, block_id: int) -> AllocatorState:
    """Write-through at free time: a host block for the cached ``block_id`` (the host free
    queue's head, else the least recently used evictable host-cached block), its key on
    the host as the most recently used, and a (device -> host) copy taken with the next
    transfers (its K/V is whole now: a copy made at eviction could not precede the
    evicting allocation's writes)."""
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


def queue_unreferenced(state: AllocatorState, block_ids: Sequence[int]) -> AllocatorState:
    """Put unreferenced blocks no copy reads any more at the queues' tails, in order: the
    cached free queue if a group caches them, else the free queue."""
    cached = {block_id for cache in state.group_caches for block_id in cache.values()}
    return replace(
        state,
        free_block_ids=state.free_block_ids + tuple(b for b in block_ids if b not in cached),
        cached_free_block_ids=state.cached_free_block_ids
        + tuple(b for b in block_ids if b in cached),
    )


def with_host(state: AllocatorState, host: HostTier) -> AllocatorState:
    """``state`` with the host tier ``host``, which may have dropped pending copies out: an
    in-flight block no copy reads any more joins a queue's tail as ``release`` sends a
    block there, in the order it went in flight."""
    pinned = pinned_block_ids(host)
    copied = [b for b in host.in_flight_block_ids if b not in pinned]
    if copied:
        flying = tuple(b for b in host.in_flight_block_ids if b in pinned)
        host = replace(host, in_flight_block_ids=flying)
    return queue_unreferenced(replace(state, host=host), copied)


def hold_in_flight(host: HostTier, block_ids: set[int]) -> HostTier:
    """``host`` with these blocks (prefix hits, held again) no longer in flight: a hit may
    take an in-flight cached block back, whose K/V a copy out only reads."""
    if not block_ids & set(host.in_flight_block_ids):
        return host
    flying = tuple(b for b in host.in_flight_block_ids if b not in block_ids)
    return replace(host, in_flight_block_ids=flying)


def get_transfers(state: AllocatorState) -> Transfers:
    """What ``take_transfers`` hands over in ``state``, in the order the KV pool does it."""
    host = state.host
    return Transfers(
        host.pending_device_to_host,
        state.pending_copies,
        host.pending_host_to_device,
        state.pending_skipped_block_ids,
    )


def take_transfers(state: AllocatorState) -> AllocatorState:
    """Clear every pending copy and the skipped blocks once the KV pool has them (read
    before, ``get_transfers``): in-flight device blocks join the device queues' tails in the
    order they went in flight, the host blocks the (host -> device) copies read join the
    host free queue's tail in copy order (unless the host prefix cache keeps them)."""
    copied = state.host.in_flight_block_ids
    host_cached = set(state.host.host_cached_block_ids)
    freed_host = tuple(h for h, _ in state.host.pending_host_to_device if h not in host_cached)
    host = replace(
        state.host,
        pending_device_to_host=(),
        pending_host_to_device=(),
        in_flight_block_ids=(),
        free_host_block_ids=state.host.free_host_block_ids + freed_host,
    )
    state = replace(state, host=host, pending_copies=(), pending_skipped_block_ids=())
    return queue_unreferenced(state, copied)


def take_events(state: AllocatorState) -> AllocatorState:
    """Clear ``events`` once they are delivered (read before). Not an operation of
    ``spec.api``: impl hands each event to its sink as it happens and keeps none."""
    return replace(state, events=())
