"""The usage report of a manager, assembled from its parts: each counts what it owns.

The pool counts blocks (in use per group, shared, evictions, copies, skips), the host tier
its blocks and copies, the manager the prefix-hit tokens and preemptions; the tables' tokens
and blocks are summed from the tables, so no counter of them is kept anywhere.
"""

from collections.abc import Collection

from impl.block_pool import BlockPool
from impl.host_tier import HostTier
from impl.tables import Table
from spec import KVBlockUsage


def usage_report(
    block_size: int,
    total_blocks: int,
    *,
    pool: BlockPool,
    host: HostTier,
    tables: Collection[Table],
    prefix_hit_tokens: int,
    preemptions: int,
) -> KVBlockUsage:
    """``spec.usage`` of a manager made of these parts; O(requests x groups)."""
    used_blocks = total_blocks - pool.free_blocks
    return KVBlockUsage(
        block_size=block_size,
        total_blocks=total_blocks,
        used_blocks=used_blocks,
        free_blocks=pool.free_blocks,
        request_count=len(tables),
        allocated_tokens=sum(table.token_count for table in tables),
        reserved_tokens=used_blocks * block_size,
        cached_blocks=sum(cache.cached_blocks for cache in pool.caches),
        shared_blocks=pool.shared_blocks,
        prefix_hit_tokens=prefix_hit_tokens,
        evictions=pool.evictions,
        cow_copies=pool.cow_copies,
        preemptions=preemptions,
        group_reserved_tokens=tuple(used * block_size for used in pool.group_used_blocks),
        skipped_blocks=pool.skipped_blocks,
        host_blocks=host.host_blocks,
        host_free_blocks=host.free_blocks,
        host_swapped_blocks=host.swapped_host_blocks,
        host_cached_blocks=len(host.lru),
        swapped_requests=len(host.swapped),
        swapped_out_blocks=host.swapped_out_blocks,
        swapped_in_blocks=host.swapped_in_blocks,
        host_hit_blocks=host.host_hit_blocks,
        cached_free_blocks=len(pool.cached_free),
        table_blocks=sum(len(held) for table in tables for held in table.group_block_ids),
        table_skipped_blocks=sum(sum(table.skipped_blocks) for table in tables),
    )
