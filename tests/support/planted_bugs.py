"""Deliberately broken allocators: each must make the state machine fail.

They prove the checks can fail. Each is the smallest change to ``KVBlockManager`` that
plants one kind of bug met in real allocators.
"""

from collections.abc import Iterable, Sequence

from impl import (
    BlockAllocationError,
    KVBlockManager,
    ReleasedBlocks,
    RequestBlockTable,
    SwappedOut,
)
from impl.block_pool import BlockPool
from impl.groups import KVCacheGroups, SlidingWindowGroup
from impl.host_pool import HostPool
from impl.prefix_cache import BlockHash, BlockKey, PrefixCache
from impl.records import AppendedSlots
from impl.tables import Table
from spec import blocks_for_tokens, check_request_id, duplicate_request


class ReleasesInTableOrder(KVBlockManager):
    """(a) Frees blocks first-block-first, against the specified last-block-first order."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        if request_id not in self._tables:
            return super().release(request_id)
        block_ids = self._tables[request_id].group_block_ids[0]
        block_ids.reverse()
        super().release(request_id)
        return block_ids[::-1]


class LeaksOneBlockOnRelease(KVBlockManager):
    """(b) Forgets to return a request's last block to the free queue."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        if request_id not in self._tables:
            return super().release(request_id)
        block_ids = list(self._tables[request_id].group_block_ids[0])
        released = super().release(request_id)
        if block_ids and block_ids[-1] in self._pool.free:
            self._pool.free.remove(block_ids[-1])
        elif block_ids and block_ids[-1] in self._pool.cached_free:
            del self._pool.cached_free[block_ids[-1]]
        return released


class RefusedAllocateTakesBlocks(KVBlockManager):
    """(c) Takes blocks before checking there are enough, and keeps them when it refuses."""

    __slots__ = ()

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        needed = self._blocks_for(token_count) * len(self.group_windows)
        check_request_id(request_id)
        if request_id in self._tables:
            duplicate_request(request_id)
        if needed > self.free_blocks:
            taken = self._pool.take(self.free_blocks, 0)  # held by no table: leaked
            raise BlockAllocationError.out_of_blocks(request_id, needed, len(taken))
        return super().allocate(request_id, token_count)


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
        block_ids = table.group_block_ids[0]
        stale = block_ids[-1] * self.block_size + offset if block_ids else None
        slot = super().append_slot(request_id)
        return slot if stale is None else stale


def weak_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """A deliberately weak hash: collides whenever two blocks' token sums match modulo 3."""
    return (parent_hash + sum(token_ids)) % 3


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


class _TrustingPrefixCache(PrefixCache):
    __slots__ = ()

    def lookup(
        self,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        hash_value: int,
        cache_salt: str | None,
    ) -> int | None:
        bucket = self.buckets.get(hash_value)
        return bucket[0] if bucket else None


class TrustsHashOnWeakHash(WeakHashOnly):
    """(f) Takes a hash match as a prefix hit without comparing token ids, under a weak hash."""

    __slots__ = ()
    prefix_cache_class = _TrustingPrefixCache


class SkipsSharedDecrement(KVBlockManager):
    """(g) Release forgets to drop the reference of a block another table still shares."""

    __slots__ = ()

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        if request_id not in self._tables:
            return super().release_blocks(request_id)
        ref_counts = self._pool.ref_counts
        shared = [b for b in self._tables[request_id].group_block_ids[0] if ref_counts[b] > 1]
        released = super().release_blocks(request_id)
        for block_id in shared:
            ref_counts[block_id] += 1
        return released


class _GrowsWithoutCopying(KVCacheGroups):
    __slots__ = ()

    def grow(self, request_id: str, table: Table, token_count: int) -> None:
        block_ids = table.group_block_ids[0]
        ref_counts = self.pool.ref_counts
        last = block_ids[-1] if block_ids else None
        if last is None or ref_counts[last] < 2:
            super().grow(request_id, table, token_count)
            return
        shared_count = ref_counts[last]
        ref_counts[last] = 1  # looks unshared to the copy-on-write test
        try:
            super().grow(request_id, table, token_count)
        finally:
            ref_counts[last] = shared_count


class SkipsCopyOnWrite(KVBlockManager):
    """(h) Appends into a shared, partly filled last block in place, without copying it."""

    groups_class = _GrowsWithoutCopying


class _ForgetfulPrefixCache(PrefixCache):
    __slots__ = ()

    def evict(self, block_id: int) -> None:
        self.cached_blocks -= 1  # counted as evicted, but the key and the bucket stay


class EvictedBlockStaysFindable(KVBlockManager):
    """(i) Reuses a cached free block without removing its prefix from the cache."""

    prefix_cache_class = _ForgetfulPrefixCache


class _KeepsTheCutBlocks(KVCacheGroups):
    __slots__ = ()

    def truncate(self, table: Table, token_count: int) -> ReleasedBlocks:
        block_ids = table.group_block_ids[0]
        keep = blocks_for_tokens(self.block_size, token_count)
        for block_id in block_ids[keep:]:
            self.pool.ref_counts[block_id] = 0  # unreferenced, but in no queue: leaked
        del block_ids[keep:]
        table.token_count = token_count
        if table.token_ids is not None and table.keys is not None:
            del table.token_ids[token_count:]
            del table.keys[token_count // self.block_size :]
        return ReleasedBlocks((), (), ())


class TruncateKeepsTheCutBlocks(KVBlockManager):
    """(j) Rollback shortens the table but never gives the blocks past the new length back."""

    groups_class = _KeepsTheCutBlocks


class _EvictionRefusingPrefixCache(PrefixCache):
    __slots__ = ("refusing",)

    def __init__(self, total_blocks: int, block_hash: BlockHash) -> None:
        super().__init__(total_blocks, block_hash)
        self.refusing = False

    def evict(self, block_id: int) -> None:
        if not self.refusing:
            super().evict(block_id)


class _TruncatesWithoutEvicting(KVCacheGroups):
    __slots__ = ()

    def truncate(self, table: Table, token_count: int) -> ReleasedBlocks:
        caches = [cache for cache in self.caches if isinstance(cache, _EvictionRefusingPrefixCache)]
        for cache in caches:
            cache.refusing = True
        try:
            return super().truncate(table, token_count)
        finally:
            for cache in caches:
                cache.refusing = False


class TruncatedBlockStaysCached(KVBlockManager):
    """(k) A cached full block that rollback leaves partly filled stays findable, so a
    later prompt would hit K/V about to be overwritten."""

    prefix_cache_class = _EvictionRefusingPrefixCache
    groups_class = _TruncatesWithoutEvicting


class TruncateUnsharesTheLastBlock(KVBlockManager):
    """(l) Rollback marks the table as holding only its own blocks, so the next append
    writes into a block it still shares (a fork's) in place, without a copy."""

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        table = super().truncate(request_id, token_count)
        self._tables[request_id].exclusive = self._tables[request_id].token_ids is None
        return table


class _SkipsEarlyWindow(SlidingWindowGroup):
    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return super().skip_target(block_size, computed_tokens + 1)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        return super().next_skip_at(block_size, skipped_blocks) - 1  # the same rule, early


class _SkipsEarly(KVCacheGroups):
    __slots__ = ()
    sliding_window_group = _SkipsEarlyWindow


class SkipsABlockOneStepEarly(KVBlockManager):
    """(m) The window rule off by one: a block goes when (b + 1) * block_size <= L0 - W + 2,
    one token before the last query that reads it."""

    groups_class = _SkipsEarly


class _NeverSkippingWindow(SlidingWindowGroup):
    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return 0


class _NeverSkipping(KVCacheGroups):
    __slots__ = ()
    sliding_window_group = _NeverSkippingWindow


class NeverSkips(KVBlockManager):
    """(n) A windowed group keeps every block, as an allocator without windows does."""

    groups_class = _NeverSkipping


class _SkipsButKeeps(KVCacheGroups):
    __slots__ = ()

    def skip(self, table: Table, group: int, drop: int) -> None:
        self.pool.skip(table.group_block_ids[group][:drop], group)


class FreesSkippedBlocksButKeepsThem(KVBlockManager):
    """(o) A hole read: the skipped blocks are freed, but ``skipped_blocks`` is not advanced
    and the table still names them, so the next request's K/V is read through it."""

    groups_class = _SkipsButKeeps


class _ResetsFreeKeysOnly(BlockPool):
    __slots__ = ()

    def reset_caches(self) -> int:
        dropped = 0
        for block_id in self.cached_free:
            self.evict(block_id)
            dropped += 1
        self.free.extend(self.cached_free)
        self.cached_free.clear()
        return dropped


class ResetKeepsTheKeysOfHeldBlocks(KVBlockManager):
    """(p) ``reset_prefix_cache`` forgets only the cached free blocks: blocks in use keep
    their keys, so a later prompt still hits K/V computed before the reset."""

    block_pool_class = _ResetsFreeKeysOnly


class _SaltBlindPrefixCache(PrefixCache):
    __slots__ = ()

    def root_hash(self, cache_salt: str | None) -> int:
        return super().root_hash(None)

    def lookup(
        self,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        hash_value: int,
        cache_salt: str | None,
    ) -> int | None:
        return super().lookup(parent, token_ids, hash_value, None)


class IgnoresTheSaltOnLookup(KVBlockManager):
    """(q) A prompt's lookup ignores its cache salt (as SGLang's salt that never reached
    the request, #23300): a salted tenant hits blocks cached with no salt."""

    prefix_cache_class = _SaltBlindPrefixCache


class _SaltsBlockZeroOnly(PrefixCache):
    __slots__ = ()

    def next_keys(
        self,
        token_ids: Sequence[int],
        keys: Sequence[BlockKey],
        new_token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
    ) -> list[BlockKey]:
        new_keys = super().next_keys(token_ids, keys, new_token_ids, block_size, cache_salt)
        for key in new_keys:
            if key.parent is not None:
                key.cache_salt = None  # only the first block carries the salt
        return new_keys


class SaltsOnlyTheFirstBlock(KVBlockManager):
    """(r) The salt keys a chain's first block but not the blocks after it, so a later
    block of one tenant's chain is cached where another tenant finds it."""

    prefix_cache_class = _SaltsBlockZeroOnly


class _RevivesUnsalted(BlockPool):
    __slots__ = ()

    def revive(self, block_ids: Iterable[int], group: int) -> None:
        block_ids = list(block_ids)
        cache = self.caches[group]
        for block_id in block_ids:
            key = cache.block_keys[block_id]
            if self.ref_counts[block_id] == 0 and key is not None and key.cache_salt is not None:
                cache.evict(block_id)  # re-cached under no salt: the salt is dropped
                cache.insert(BlockKey(key.parent, key.token_ids, key.hash_value, None), block_id)
        super().revive(block_ids, group)


class ReviveDropsTheSalt(KVBlockManager):
    """(s) Reviving a cached free block for a prefix hit re-caches it without its salt, so
    an unsalted prompt would hit one tenant's K/V."""

    block_pool_class = _RevivesUnsalted


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
    ResetKeepsTheKeysOfHeldBlocks,
    IgnoresTheSaltOnLookup,
    SaltsOnlyTheFirstBlock,
    ReviveDropsTheSalt,
]

# The bugs of the window rule: they live where only a pool with a sliding window goes, so
# the windowed state machine and the window walk of the bounded checker must catch them.
WINDOW_PLANTED_BUGS: list[type[KVBlockManager]] = [
    SkipsABlockOneStepEarly,
    NeverSkips,
    FreesSkippedBlocksButKeepsThem,
]

# -- the engine's queries --------------------------------------------------------------
# Bugs in what chunked prefill and speculative rollback ask the manager. The lockstep
# machine must catch them; the bounded checker walks the allocating operations only.


class RollbackReportsCachedBlocksAsFreed(KVBlockManager):
    """(m) ``truncate_blocks`` reports every dropped block as freed, cached ones too, so
    the engine would poison K/V a later prefix hit revives."""

    __slots__ = ()

    def truncate_blocks(self, request_id: str, token_count: int) -> ReleasedBlocks:
        released = super().truncate_blocks(request_id, token_count)
        freed = released.freed_block_ids + released.cached_block_ids
        return ReleasedBlocks(released.block_ids, freed, ())


class PrefixQueryCoversTheLastToken(KVBlockManager):
    """(n) ``cached_prefix_tokens`` counts a cached block holding the prompt's last token,
    so a chunked prefill would feed nothing and sample from no logits."""

    __slots__ = ()

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        hit = super().cached_prefix_tokens(token_ids, cache_salt)
        ids = tuple(token_ids)
        whole = ids[: hit + self.block_size]
        if len(whole) == len(ids) and len(ids) % self.block_size == 0:
            for block_id in range(self.total_blocks):
                key = self._groups.caches[0].block_keys[block_id]
                if key is not None and key.prefix() == whole:
                    return len(ids)
        return hit


QUERY_BUGS: list[type[KVBlockManager]] = [
    RollbackReportsCachedBlocksAsFreed,
    PrefixQueryCoversTheLastToken,
]

# -- the all-groups step API -------------------------------------------------------------
# Bugs in what one engine step asks at once; the windowed lockstep machine must catch them
# (it has several groups, windows and forks).


class StepSlotsIgnoreTheWindow(KVBlockManager):
    """``append_slots`` and friends compute a windowed group's slots as if it skipped
    nothing, so a step would write K/V through the wrong block."""

    def _appended_slots(self, request_id: str, table: Table, token_count: int) -> AppendedSlots:
        step = super()._appended_slots(request_id, table, token_count)
        end = table.token_count
        slots = tuple(
            tuple(
                held[min(p // self.block_size, len(held) - 1)] * self.block_size
                + p % self.block_size
                for p in range(end - token_count, end)
            )
            for held in table.group_block_ids
        )
        return AppendedSlots(step.tables, slots)


class RollbackCallsSharedSlotsStale(KVBlockManager):
    """``truncate_blocks`` reports the rolled-back slots of a kept last block a fork still
    holds, so the engine would poison K/V the other request reads."""

    def truncate_blocks(self, request_id: str, token_count: int) -> ReleasedBlocks:
        before = self.snapshot_groups(request_id) if request_id in self._tables else ()
        released = super().truncate_blocks(request_id, token_count)
        stale = []
        for group, (table, reported) in enumerate(zip(before, released.stale_slots, strict=True)):
            kept = self.snapshot_request(request_id, group)
            slots = reported
            if not slots and token_count % self.block_size and kept.block_ids:
                end = min(
                    table.token_count, (kept.skipped_blocks + len(kept.block_ids)) * self.block_size
                )
                slots = tuple(
                    kept.block_ids[-1] * self.block_size + p % self.block_size
                    for p in range(token_count, end)
                )
            stale.append(slots)
        return ReleasedBlocks(
            released.block_ids, released.freed_block_ids, released.cached_block_ids, tuple(stale)
        )


STEP_API_BUGS: list[type[KVBlockManager]] = [
    StepSlotsIgnoreTheWindow,
    RollbackCallsSharedSlotsStale,
]


# -- the host tier ----------------------------------------------------------------------
# Bugs of preemption by swap; the host-tier lockstep machine and the host-tier bounded
# walk must both catch each (tests/allocator/test_host_tier_state_machine.py,
# test_bounded.py's HOST_SHORTEST_FAILURES).


class _LeaksOnTakeHostPool(HostPool):
    __slots__ = ()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, back = super().take_copies()
        if back:
            self.free.pop()  # the last host block a copy in read never comes back
        return out, back


class _LeaksOnTakePool(BlockPool):
    __slots__ = ()
    host_pool_class = _LeaksOnTakeHostPool


class LeaksAHostBlockOnSwapIn(KVBlockManager):
    """A host block a swap-in read is not freed when its copy is taken: the host tier
    shrinks by a block per swap-in."""

    __slots__ = ()
    block_pool_class = _LeaksOnTakePool


class _ForgetsCopiesOutHostPool(HostPool):
    __slots__ = ()

    def copy_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.pending_out += zip(device_ids, host_ids, strict=True)  # no block marked read


class _ForgetsCopiesOutPool(BlockPool):
    __slots__ = ()
    host_pool_class = _ForgetsCopiesOutHostPool


class ReusesABlockBeforeItsCopyOut(KVBlockManager):
    """A swapped-out block goes straight to the free queue, so the next allocation may
    overwrite it before its copy to the host is made (vLLM #47653)."""

    __slots__ = ()
    block_pool_class = _ForgetsCopiesOutPool


class SwapInForgetsTheOtherHolder(KVBlockManager):
    """A swap-in that restores sharing: a block whose original is still held by the
    request's fork sibling gets that original back, without a reference for the
    swapped-in request, so the sibling's release frees a block still in use."""

    __slots__ = ("_origins",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._origins: dict[str, list[list[int]]] = {}

    def swap_out(self, request_id: str) -> SwappedOut:
        origins = [list(held) for held in self._table(request_id).group_block_ids]
        swapped = super().swap_out(request_id)
        self._origins[request_id] = origins
        return swapped

    def swap_in(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        super().swap_in(request_id)
        origins = self._origins.pop(request_id)
        table = self._tables[request_id]
        pool = self._pool
        for held, original in zip(table.group_block_ids, origins, strict=True):
            for index, (fresh, block_id) in enumerate(zip(held, original, strict=True)):
                if pool.ref_counts[block_id] > 0 and fresh != block_id:
                    held[index] = block_id  # shared again, but no reference added
                    pool.ref_counts[fresh] = 0
                    pool.free.appendleft(fresh)
                    pool.counters.group_used_blocks[0] -= 1
                    host = pool.host
                    host.free.extend(h for h, d in host.pending_in if d == fresh)
                    host.pending_in = [(h, d) for h, d in host.pending_in if d != fresh]
        return self.snapshot_groups(request_id)


class _RevivesFromTheHostUnsalted(BlockPool):
    __slots__ = ()

    def revive_from_host(
        self, group: int, host_hits: list[tuple[int, int]], keys: list[BlockKey]
    ) -> list[int]:
        unsalted = [BlockKey(k.parent, k.token_ids, k.hash_value, None) for k in keys]
        return super().revive_from_host(group, host_hits, unsalted)


class RevivesADemotedPrefixUnsalted(KVBlockManager):
    """A prefix hit on the host caches the revived device block under its tokens without
    the salt: another tenant's prompt then hits it (the key revived wrong)."""

    __slots__ = ()
    block_pool_class = _RevivesFromTheHostUnsalted


HOST_TIER_BUGS: list[type[KVBlockManager]] = [
    LeaksAHostBlockOnSwapIn,
    ReusesABlockBeforeItsCopyOut,
    SwapInForgetsTheOtherHolder,
    RevivesADemotedPrefixUnsalted,
]
