"""The host tier's state: a second pool of host-memory blocks, the requests swapped out to
it, the copies between the tiers that the KV pool has not made yet, and the host prefix
cache.

A host block and a device block are different resources: host block ids are
``0 .. host_blocks - 1``, with their own free queue (head first, FIFO like the device's).
This module holds the frozen records and the pure helpers that read them; the transitions
that move requests between the tiers are ``spec.swap``'s, and the device side of a
release (where an unreferenced block goes) is ``spec.blocks``'.

The pending-copy rule. A device block that is the source of a swap-out's pending
(device -> host) copy, or the destination of a pending (host -> device) copy, is "in
flight" once no table holds it: it is in no free queue and nothing can take it until
``take_transfers`` hands the copy to the caller; then it goes where ``release`` would
have put it. A host block that is the source of a pending (host -> device) copy is not
reused until that copy is taken either.

A demotion's copy (the host prefix cache's, into a host-cached block) pins nothing: the
demoted block joins the cached free queue where a pool without a host tier puts it, so
the device behaves the same with a host tier or without one, and the host only adds hits.
An allocation that evicts the block before the copy is taken makes the demotion moot: the
copy is dropped, its key forgotten on the host and its host block freed
(``drop_moot_demotion``), so a block handed out is never read by a pending copy.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from spec.frozen_map import FrozenMap
from spec.records import CacheKey


@dataclass(frozen=True, slots=True)
class SwappedRequest:
    """What a swapped-out request keeps: its host blocks per KV cache group (in table order,
    from block index ``group_skipped_blocks[g]`` on), its length, and its token ids and
    salt if it tracks them."""

    group_host_block_ids: tuple[tuple[int, ...], ...]
    token_count: int
    group_skipped_blocks: tuple[int, ...]
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None

    @property
    def host_block_ids(self) -> tuple[int, ...]:
        """Every group's host blocks, group 0's first."""
        return tuple(block_id for group in self.group_host_block_ids for block_id in group)


@dataclass(frozen=True, slots=True)
class HostCounters:
    """Running totals of the host tier, for the usage report: device blocks copied out by
    swap-outs, copied back by swap-ins, and blocks a prefix hit found on the host only."""

    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    host_hit_blocks: int = 0


@dataclass(frozen=True, slots=True)
class HostTier:
    """The host pool of ``host_blocks`` blocks.

    ``pending_device_to_host`` lists (device block, host block) copies and
    ``pending_host_to_device`` (host block, device block) copies, in the order they were
    made; ``in_flight_block_ids`` the device blocks a pending copy reads or writes that no
    table holds, in the order their last reference was dropped (release order). With
    ``host_prefix_cache``, ``host_caches[g]`` maps a cache key of group g to the host block
    holding a copy of it, and ``host_cached_block_ids`` lists those host blocks,
    least recently used first.
    """

    host_blocks: int = 0
    free_host_block_ids: tuple[int, ...] = ()
    swapped: FrozenMap[str, SwappedRequest] = field(default_factory=FrozenMap[str, SwappedRequest])
    pending_device_to_host: tuple[tuple[int, int], ...] = ()
    pending_host_to_device: tuple[tuple[int, int], ...] = ()
    in_flight_block_ids: tuple[int, ...] = ()
    counters: HostCounters = HostCounters()
    host_prefix_cache: bool = False
    host_caches: tuple[FrozenMap[CacheKey, int], ...] = ()
    host_cached_block_ids: tuple[int, ...] = ()


def init_host_tier(host_blocks: int, host_prefix_cache: bool, group_count: int) -> HostTier:
    """An empty host pool, its free queue in id order, one host cache per group."""
    return HostTier(
        host_blocks=host_blocks,
        free_host_block_ids=tuple(range(host_blocks)),
        host_prefix_cache=host_prefix_cache,
        host_caches=tuple(FrozenMap[CacheKey, int]() for _ in range(group_count)),
    )


def pinned_block_ids(host: HostTier) -> set[int]:
    """The device blocks a pending copy pins (the pending-copy rule): the sources of the
    copies out into blocks the host does not cache (a swap-out's) and the destinations of
    the copies in. One of them that no table holds is in flight."""
    cached = set(host.host_cached_block_ids)
    return {d for d, h in host.pending_device_to_host if h not in cached} | {
        d for _, d in host.pending_host_to_device
    }


def demoting_block_ids(host: HostTier) -> set[int]:
    """The device blocks a pending demotion reads: the sources of the copies out into
    host-cached blocks. They pin nothing (the module's rule)."""
    cached = set(host.host_cached_block_ids)
    return {d for d, h in host.pending_device_to_host if h in cached}


def drop_moot_demotion(host: HostTier, block_id: int) -> HostTier:
    """``host`` once an allocation evicted device block ``block_id``: a pending demotion of
    it is moot (its K/V is about to be overwritten), so its copy is dropped, its key
    forgotten and its host block freed to the host free queue's tail."""
    cached = set(host.host_cached_block_ids)
    moot = tuple(h for d, h in host.pending_device_to_host if d == block_id and h in cached)
    if not moot:
        return host
    return release_host_blocks(drop_host_keys(host, moot), moot)


def copying_in_host_block_ids(host: HostTier) -> tuple[int, ...]:
    """The host blocks a pending (host -> device) copy reads, in copy order."""
    return tuple(host_block for host_block, _ in host.pending_host_to_device)


def evictable_host_block_ids(host: HostTier) -> tuple[int, ...]:
    """Host-cached blocks a swap-out or a demotion may take, least recently used first: those
    no pending copy reads or writes."""
    copying = {h for _, h in host.pending_device_to_host} | set(copying_in_host_block_ids(host))
    return tuple(h for h in host.host_cached_block_ids if h not in copying)


def host_free_blocks(host: HostTier) -> int:
    """Host blocks a swap-out may take now: the free queue and the evictable cached ones."""
    return len(host.free_host_block_ids) + len(evictable_host_block_ids(host))


def swapped_host_block_ids(host: HostTier) -> set[int]:
    """Every host block a swapped-out request holds."""
    return {b for swapped in host.swapped.values() for b in swapped.host_block_ids}


def drop_host_keys(host: HostTier, host_block_ids: Iterable[int]) -> HostTier:
    """``host`` with these host blocks' cache keys forgotten (they are being reused)."""
    gone = set(host_block_ids)
    if not gone & set(host.host_cached_block_ids):
        return host
    return replace(
        host,
        host_caches=tuple(
            FrozenMap({key: h for key, h in cache.items() if h not in gone})
            for cache in host.host_caches
        ),
        host_cached_block_ids=tuple(h for h in host.host_cached_block_ids if h not in gone),
    )


def take_host_blocks(host: HostTier, count: int) -> tuple[HostTier, tuple[int, ...]]:
    """Take ``count`` host blocks: the free queue's head first, then the least recently used
    evictable cached ones, whose keys are forgotten. The caller has checked there are
    enough (``host_free_blocks``)."""
    from_free = host.free_host_block_ids[:count]
    evicted = evictable_host_block_ids(host)[: count - len(from_free)]
    host = replace(host, free_host_block_ids=host.free_host_block_ids[len(from_free) :])
    return drop_host_keys(host, evicted), from_free + evicted


def release_host_blocks(host: HostTier, host_block_ids: Iterable[int]) -> HostTier:
    """``host`` with these host blocks (in release order) at the tail of the host free
    queue, and without the pending copies into them (moot)."""
    released = tuple(host_block_ids)
    gone = set(released)
    return replace(
        host,
        free_host_block_ids=host.free_host_block_ids + released,
        pending_device_to_host=tuple(
            (d, h) for d, h in host.pending_device_to_host if h not in gone
        ),
    )
