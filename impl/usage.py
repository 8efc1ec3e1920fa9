"""The usage counters: running totals kept as operations happen, so ``usage()`` is O(1).

The block pool counts what happens to blocks (sharing, eviction, copies, skips, each
group's used blocks); the front counts tokens and preemptions. Neither scans a table.
"""

from impl.host_pool import HostPool
from spec import KVBlockUsage


class UsageCounters:
    """The running totals behind ``KVBlockManager.usage``; ``group_used_blocks[g]`` counts
    the blocks KV cache group g holds (one per block, however many tables share it)."""

    __slots__ = (
        "allocated_tokens",
        "cow_copies",
        "evictions",
        "group_used_blocks",
        "preemptions",
        "prefix_hit_tokens",
        "shared_blocks",
        "skipped_blocks",
    )

    def __init__(self, group_count: int) -> None:
        self.allocated_tokens = 0
        self.shared_blocks = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0
        self.cow_copies = 0
        self.preemptions = 0
        self.skipped_blocks = 0
        self.group_used_blocks = [0] * group_count

    def report(
        self,
        total_blocks: int,
        block_size: int,
        free_blocks: int,
        request_count: int,
        cached_blocks: int,
        *,
        host: HostPool,
    ) -> KVBlockUsage:
        """The usage report of a pool with ``free_blocks`` free, these totals and the host
        tier ``host``."""
        used_blocks = total_blocks - free_blocks
        return KVBlockUsage(
            block_size=block_size,
            total_blocks=total_blocks,
            used_blocks=used_blocks,
            free_blocks=free_blocks,
            request_count=request_count,
            allocated_tokens=self.allocated_tokens,
            reserved_tokens=used_blocks * block_size,
            cached_blocks=cached_blocks,
            shared_blocks=self.shared_blocks,
            prefix_hit_tokens=self.prefix_hit_tokens,
            evictions=self.evictions,
            cow_copies=self.cow_copies,
            preemptions=self.preemptions,
            group_reserved_tokens=tuple(used * block_size for used in self.group_used_blocks),
            skipped_blocks=self.skipped_blocks,
            host_blocks=host.host_blocks,
            host_free_blocks=host.free_blocks,
            host_swapped_blocks=host.swapped_host_blocks,
            host_cached_blocks=len(host.lru),
            swapped_requests=len(host.swapped),
            swapped_out_blocks=host.swapped_out_blocks,
            swapped_in_blocks=host.swapped_in_blocks,
            host_hit_blocks=host.host_hit_blocks,
        )
