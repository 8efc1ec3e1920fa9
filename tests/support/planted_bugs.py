"""Deliberately broken allocators: each must make the state machine fail.

They prove the checks can fail. Each is the smallest change to ``KVBlockManager`` that
plants one kind of bug met in real allocators.
"""

from impl import (
    BlockAllocationError,
    BlockKey,
    KVBlockManager,
    PrefixCache,
    ReleasedBlocks,
    RequestBlockTable,
)
from impl.manager import _Table
from impl.prefix_cache import BlockHash
from spec import check_request_id, duplicate_request


class ReleasesInTableOrder(KVBlockManager):
    """(a) Frees blocks first-block-first, against the specified last-block-first order."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        if request_id not in self._tables:
            return super().release(request_id)
        block_ids = self._tables[request_id].block_ids
        block_ids.reverse()
        super().release(request_id)
        return block_ids[::-1]


class LeaksOneBlockOnRelease(KVBlockManager):
    """(b) Forgets to return a request's last block to the free queue."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        if request_id not in self._tables:
            return super().release(request_id)
        block_ids = list(self._tables[request_id].block_ids)
        released = super().release(request_id)
        if block_ids and block_ids[-1] in self._free:
            self._free.remove(block_ids[-1])
        elif block_ids and block_ids[-1] in self._cached_free:
            del self._cached_free[block_ids[-1]]
        return released


class RefusedAllocateTakesBlocks(KVBlockManager):
    """(c) Takes blocks before checking there are enough, and keeps them when it refuses."""

    __slots__ = ()

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        needed = self._blocks_for(token_count)
        check_request_id(request_id)
        if request_id in self._tables:
            duplicate_request(request_id)
        taken = self._take(min(needed, self.free_blocks))
        if len(taken) < needed:
            raise BlockAllocationError.out_of_blocks(request_id, needed, len(taken))
        self._tables[request_id] = _Table(taken, token_count)
        self._allocated_tokens += token_count
        return RequestBlockTable(request_id, list(taken), token_count)


class OffByOneAtBlockBoundary(KVBlockManager):
    """(d) Sizes tables as token_count // block_size + 1: one block too many on a boundary."""

    __slots__ = ()

    def _blocks_for(self, token_count: int) -> int:
        super()._blocks_for(token_count)  # the argument checks
        return token_count // self.block_size + 1


class DecodeSlotFromStaleBlock(KVBlockManager):
    """(e) The hot decode path computes the slot from the block it had before opening a new one."""

    __slots__ = ()

    def append_slot(self, request_id: str) -> int:
        if request_id not in self._tables:
            return super().append_slot(request_id)
        table = self._tables[request_id]
        offset = table.token_count % self.block_size
        stale = table.block_ids[-1] * self.block_size + offset if table.block_ids else None
        slot = super().append_slot(request_id)
        return slot if stale is None else stale


def weak_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """A deliberately weak hash: collides whenever two blocks' token sums match modulo 3."""
    return (parent_hash + sum(token_ids)) % 3


class TrustsHashOnWeakHash(KVBlockManager):
    """(f) Takes a hash match as a prefix hit without comparing token ids, under a weak hash."""

    __slots__ = ()

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        super().__init__(
            total_blocks, block_size, block_hash=weak_block_hash, group_windows=group_windows
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._prefix_cache = self._prefix_caches[0] = _TrustingPrefixCache(
            self.total_blocks, self.block_hash
        )


class _TrustingPrefixCache(PrefixCache):
    __slots__ = ()

    def lookup(
        self, parent: BlockKey | None, token_ids: tuple[int, ...], hash_value: int
    ) -> int | None:
        bucket = self.buckets.get(hash_value)
        return bucket[0] if bucket else None


class WeakHashOnly(KVBlockManager):
    """Not a bug: the real allocator under the weak hash must still agree with the spec."""

    __slots__ = ()

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        super().__init__(
            total_blocks, block_size, block_hash=weak_block_hash, group_windows=group_windows
        )


class SkipsSharedDecrement(KVBlockManager):
    """(g) Release forgets to drop the reference of a block another table still shares."""

    __slots__ = ()

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        if request_id not in self._tables:
            return super().release_blocks(request_id)
        shared = [b for b in self._tables[request_id].block_ids if self._ref_counts[b] > 1]
        released = super().release_blocks(request_id)
        for block_id in shared:
            self._ref_counts[block_id] += 1
        return released


class SkipsCopyOnWrite(KVBlockManager):
    """(h) Appends into a shared, partly filled last block in place, without copying it."""

    __slots__ = ()

    def _grow(self, request_id: str, table: _Table, token_count: int) -> None:
        last = table.block_ids[-1] if table.block_ids else None
        if last is None or self._ref_counts[last] < 2:
            super()._grow(request_id, table, token_count)
            return
        shared_count = self._ref_counts[last]
        self._ref_counts[last] = 1  # looks unshared to the copy-on-write test
        try:
            super()._grow(request_id, table, token_count)
        finally:
            self._ref_counts[last] = shared_count


class EvictedBlockStaysFindable(KVBlockManager):
    """(i) Reuses a cached free block without removing its prefix from the cache."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._prefix_cache = self._prefix_caches[0] = _ForgetfulPrefixCache(
            self.total_blocks, self.block_hash
        )


class _ForgetfulPrefixCache(PrefixCache):
    __slots__ = ()

    def evict(self, block_id: int) -> None:
        self.cached_blocks -= 1  # counted as evicted, but the key and the bucket stay


class TruncateKeepsTheCutBlocks(KVBlockManager):
    """(j) Rollback shortens the table but never gives the blocks past the new length back."""

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        if (
            request_id not in self._tables
            or not 0 <= token_count <= self._tables[request_id].token_count
        ):
            return super().truncate(request_id, token_count)
        table = self._tables[request_id]
        keep = -(-token_count // self.block_size)
        for block_id in table.block_ids[keep:]:
            self._ref_counts[block_id] = 0  # unreferenced, but in no queue: leaked
        del table.block_ids[keep:]
        self._allocated_tokens -= table.token_count - token_count
        table.token_count = token_count
        if table.token_ids is not None and table.keys is not None:
            del table.token_ids[token_count:]
            del table.keys[token_count // self.block_size :]
        return self.snapshot_request(request_id)


class TruncatedBlockStaysCached(KVBlockManager):
    """(k) A cached full block that rollback leaves partly filled stays findable, so a
    later prompt would hit K/V about to be overwritten."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._prefix_cache = self._prefix_caches[0] = _EvictionRefusingPrefixCache(
            self.total_blocks, self.block_hash
        )

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        assert isinstance(self._prefix_cache, _EvictionRefusingPrefixCache)
        self._prefix_cache.refusing = True
        try:
            return super().truncate(request_id, token_count)
        finally:
            self._prefix_cache.refusing = False


class _EvictionRefusingPrefixCache(PrefixCache):
    __slots__ = ("refusing",)

    def __init__(self, total_blocks: int, block_hash: BlockHash) -> None:
        super().__init__(total_blocks, block_hash)
        self.refusing = False

    def evict(self, block_id: int) -> None:
        if not self.refusing:
            super().evict(block_id)


class TruncateUnsharesTheLastBlock(KVBlockManager):
    """(l) Rollback marks the table as holding only its own blocks, so the next append
    writes into a block it still shares (a fork's) in place, without a copy."""

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        table = super().truncate(request_id, token_count)
        self._tables[request_id].exclusive = self._tables[request_id].token_ids is None
        return table


class SkipsABlockOneStepEarly(KVBlockManager):
    """(m) The window rule off by one: a block goes when (b + 1) * block_size <= L0 - W + 2,
    one token before the last query that reads it."""

    def _skip_target(self, group: int, computed_tokens: int) -> int:
        return super()._skip_target(group, computed_tokens + 1)


class NeverSkips(KVBlockManager):
    """(n) A windowed group keeps every block, as an allocator without windows does."""

    def _skip_target(self, group: int, computed_tokens: int) -> int:
        return 0


class FreesSkippedBlocksButKeepsThem(KVBlockManager):
    """(o) A hole read: the skipped blocks are freed, but ``skipped_blocks`` is not advanced
    and the table still names them, so the next request's K/V is read through it."""

    def _skip_out_of_window(self, table: _Table, group: int, drop: int) -> None:
        held = table.group_block_ids[group]
        freed, _ = self._release_in_order(held[:drop], group)
        for block_id in freed:
            self._pending_skipped[block_id] = None


PLANTED_BUGS: list[type[KVBlockManager]] = [
    ReleasesInTableOrder,
    LeaksOneBlockOnRelease,
    RefusedAllocateTakesBlocks,
    OffByOneAtBlockBoundary,
    DecodeSlotFromStaleBlock,
    TrustsHashOnWeakHash,
    SkipsSharedDecrement,
    SkipsCopyOnWrite,
    EvictedBlockStaysFindable,
    TruncateKeepsTheCutBlocks,
    TruncatedBlockStaysCached,
    TruncateUnsharesTheLastBlock,
]

# The bugs of the window rule: they live where only a pool with a sliding window goes, so
# the windowed state machine and the window walk of the bounded checker must catch them.
WINDOW_PLANTED_BUGS: list[type[KVBlockManager]] = [
    SkipsABlockOneStepEarly,
    NeverSkips,
    FreesSkippedBlocksButKeepsThem,
]
