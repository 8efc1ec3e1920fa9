"""The impl -> spec state mapping and the self-check, for tests and checkers (O(pool)).

Nothing on an engine's path calls these: they read the pool, the groups' caches and the
tables and build the ``spec.AllocatorState`` they stand for, so a test can compare it
with the spec's and run the spec's invariants on it.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import spec
from impl.block_pool import BlockPool
from impl.host_tier import HostTier
from impl.prefix_cache import PrefixCache
from impl.tables import Table

if TYPE_CHECKING:
    from impl.manager import KVCacheManager

from spec import (
    AllocatorState,
    CacheKey,
    FrozenMap,
    HostCounters,
    KVBlockUsage,
    SharingCounters,
    SwappedRequest,
    violated_invariants,
)


def to_spec(
    block_size: int,
    group_windows: tuple[int | None, ...],
    *,
    pool: BlockPool,
    host: HostTier,
    tables: Mapping[str, Table],
    prefix_hit_tokens: int,
    preemptions: int,
) -> AllocatorState:
    """The spec state of a pool, its host tier and these tables."""
    return AllocatorState(
        block_size=block_size,
        total_blocks=len(pool.ref_counts),
        free_block_ids=tuple(pool.free),
        group_tables=tuple(
            FrozenMap(
                {
                    request_id: spec.RequestBlockTable(
                        request_id,
                        tuple(table.group_block_ids[group]),
                        table.token_count,
                        table.skipped_blocks[group],
                    )
                    for request_id, table in tables.items()
                }
            )
            for group in range(len(group_windows))
        ),
        cached_free_block_ids=tuple(pool.cached_free),
        cache_salts=FrozenMap(
            {
                request_id: table.cache_salt
                for request_id, table in tables.items()
                if table.cache_salt is not None
            }
        ),
        ref_counts=FrozenMap(
            {block_id: count for block_id, count in enumerate(pool.ref_counts) if count}
        ),
        token_ids=FrozenMap(
            {
                request_id: tuple(table.token_ids)
                for request_id, table in tables.items()
                if table.token_ids is not None
            }
        ),
        group_caches=tuple(FrozenMap(dict(cache.prefixes())) for cache in pool.caches),
        pending_copies=tuple(pool.pending_copies),
        counters=SharingCounters(
            prefix_hit_tokens=prefix_hit_tokens,
            evictions=pool.evictions,
            cow_copies=pool.cow_copies,
            preemptions=preemptions,
            skipped_blocks=pool.skipped_blocks,
        ),
        group_windows=group_windows,
        pending_skipped_block_ids=tuple(pool.pending_skipped),
        host=_host_tier(host, len(group_windows)),
    )


def _host_tier(host: HostTier, group_count: int) -> spec.HostTier:
    """The spec state of the host tier."""
    return spec.HostTier(
        host_blocks=host.host_blocks,
        free_host_block_ids=tuple(host.free),
        swapped=FrozenMap(
            {
                request_id: SwappedRequest(
                    tuple(tuple(group) for group in swapped.group_host_block_ids),
                    swapped.table.token_count,
                    tuple(swapped.table.skipped_blocks),
                    None if swapped.table.token_ids is None else tuple(swapped.table.token_ids),
                    swapped.table.cache_salt,
                )
                for request_id, swapped in host.swapped.items()
            }
        ),
        pending_device_to_host=tuple(host.pending_out),
        pending_host_to_device=tuple(host.pending_in),
        in_flight_block_ids=tuple(host.in_flight),
        counters=HostCounters(
            swapped_out_blocks=host.swapped_out_blocks,
            swapped_in_blocks=host.swapped_in_blocks,
            host_hit_blocks=host.host_hit_blocks,
        ),
        host_prefix_cache=host.prefix_cache,
        host_caches=tuple(FrozenMap(dict(cache.prefixes())) for cache in host.caches)
        or tuple(FrozenMap[CacheKey, int]() for _ in range(group_count)),
        host_cached_block_ids=tuple(host.lru),
    )


def check_invariants(
    state: AllocatorState, usage: KVBlockUsage, caches: Sequence[PrefixCache]
) -> None:
    """Raise ``AssertionError`` naming every spec invariant ``state`` breaks, a usage report
    that differs from the spec's, or a cache whose index disagrees with itself."""
    broken = violated_invariants(state)
    if usage != spec.usage(state):
        broken.append(f"usage counters: {usage} != {spec.usage(state)}")
    _raise_if_broken(broken + _broken_indexes(caches))


def check_indexes(manager: "KVCacheManager") -> None:
    """Raise ``AssertionError`` if a prefix cache of ``manager`` has a hash index that
    disagrees with its cached blocks: the one part of ``check_invariants`` that
    ``to_spec()`` cannot show. A checker that has compared ``to_spec()`` with a spec state
    whose invariants hold needs only this."""
    _raise_if_broken(_broken_indexes(manager._pool.caches))


def _broken_indexes(caches: Sequence[PrefixCache]) -> list[str]:
    if all(cache.is_index_consistent() for cache in caches):
        return []
    return ["cache index: hash buckets, block keys and count disagree"]


def _raise_if_broken(broken: list[str]) -> None:
    if broken:
        # An explicit raise, not ``assert``: it must survive ``python -O``.
        raise AssertionError(f"allocator invariants broken: {', '.join(broken)}")
