"""Deliberately broken allocators: each must make the state machine fail.

They prove the checks can fail. Each is the smallest change to ``KVCacheManager`` that
plants one kind of bug met in real allocators.
"""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import spec
from impl import (
    AppendedSlots,
    BlockAllocationError,
    KVCacheManager,
    ReleasedBlocks,
)
from impl.block_pool import BlockPool
from impl.group_kinds import IMPL_KINDS, FullAttentionGroup, SlidingWindowGroup
from impl.groups import KVCacheGroups
from impl.host_tier import GroupBlock, HostTier
from impl.prefix_cache import BlockKey, EventSink, PrefixCache
from impl.prefix_hits import PrefixHits
from impl.tables import Table
from spec import (
    AllBlocksCleared,
    BlockRemoved,
    blocks_for_tokens,
    check_request_id,
    duplicate_request,
)


class ReleasesInTableOrder(KVCacheManager):
    """(a) Frees blocks first-block-first, against the specified last-block-first order."""

    def release(self, request_id: str) -> ReleasedBlocks:
        if request_id not in self._tables:
            return super().release(request_id)
        self._tables[request_id].group_block_ids[0].reverse()
        released = super().release(request_id)
        return dataclasses.replace(released, block_ids=released.block_ids[::-1])


class LeaksOneBlockOnRelease(KVCacheManager):
    """(b) Forgets to return a request's last block to the free queue."""

    def release(self, request_id: str) -> ReleasedBlocks:
        if request_id not in self._tables:
            return super().release(request_id)
        block_ids = list(self._tables[request_id].group_block_ids[0])
        released = super().release(request_id)
        if block_ids and block_ids[-1] in self._pool.free:
            self._pool.free.remove(block_ids[-1])
        elif block_ids and block_ids[-1] in self._pool.cached_free:
            del self._pool.cached_free[block_ids[-1]]
        return released


class RefusedAllocateTakesBlocks(KVCacheManager):
    """(c) Takes blocks before checking there are enough, and keeps them when it refuses."""

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        if type(tokens) is int and tokens >= 0:
            needed = blocks_for_tokens(self.block_size, tokens) * len(self.group_windows)
            check_request_id(request_id)
            if request_id in self._tables:
                duplicate_request(request_id)
            free = self._pool.free_blocks
            if needed > free:
                taken = self._pool.take(free, 0)  # held by no table: leaked
                raise BlockAllocationError.out_of_blocks(request_id, needed, len(taken))
        return super().allocate(request_id, tokens, cache_salt)


class _OffByOneGroup(FullAttentionGroup):
    __slots__ = ()

    def table_blocks(self, block_size: int, token_count: int) -> int:
        return token_count // block_size + 1


class _OffByOne(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        spec.FullAttention: _OffByOneGroup,
    }


class OffByOneAtBlockBoundary(KVCacheManager):
    """(d) Sizes tables as token_count // block_size + 1: one block too many on a boundary."""

    groups_class = _OffByOne


class DecodeSlotFromStaleBlock(KVCacheManager):
    """(e) The decode append computes the slot from the block it had before opening a new one."""

    def append(self, request_id: str, tokens: int | Sequence[int] = 1) -> AppendedSlots:
        if request_id not in self._tables or tokens != 1:
            return super().append(request_id, tokens)
        table = self._tables[request_id]
        offset = table.token_count % self.block_size
        block_ids = table.group_block_ids[0]
        last = block_ids[-1] if block_ids else None
        appended = super().append(request_id, tokens)
        if last is None:
            return appended
        stale = ((last * self.block_size + offset,), *appended.slots[1:])
        return appended._replace(slots=stale)


def weak_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """A deliberately weak hash: collides whenever two blocks' token sums match modulo 3."""
    return (parent_hash + sum(token_ids)) % 3


class WeakHashOnly(KVCacheManager):
    """Not a bug: the real allocator under the weak hash must still agree with the spec."""

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: tuple[int | None, ...] = (None,),
        event_sink: EventSink | None = None,
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
    ) -> None:
        super().__init__(
            total_blocks,
            block_size,
            block_hash=weak_block_hash,
            group_windows=group_windows,
            event_sink=event_sink,
            host_blocks=host_blocks,
            host_prefix_cache=host_prefix_cache,
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


class SkipsSharedDecrement(KVCacheManager):
    """(g) Release forgets to drop the reference of a block another table still shares."""

    def release(self, request_id: str) -> ReleasedBlocks:
        if request_id not in self._tables:
            return super().release(request_id)
        ref_counts = self._pool.ref_counts
        shared = [b for b in self._tables[request_id].group_block_ids[0] if ref_counts[b] > 1]
        released = super().release(request_id)
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


class SkipsCopyOnWrite(KVCacheManager):
    """(h) Appends into a shared, partly filled last block in place, without copying it."""

    groups_class = _GrowsWithoutCopying


class _ForgetfulPrefixCache(PrefixCache):
    __slots__ = ()

    def evict(self, block_id: int) -> None:
        self.cached_blocks -= 1  # counted as evicted, but the key and the bucket stay


class EvictedBlockStaysFindable(KVCacheManager):
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
        table.changed()
        if table.token_ids is not None and table.keys is not None:
            del table.token_ids[token_count:]
            del table.keys[token_count // self.block_size :]
        return ReleasedBlocks((), (), ())


class TruncateKeepsTheCutBlocks(KVCacheManager):
    """(j) Rollback shortens the table but never gives the blocks past the new length back."""

    groups_class = _KeepsTheCutBlocks


class _EvictionRefusingPrefixCache(PrefixCache):
    # No __slots__: ``spared`` is set on an instance, over this class-level default.
    spared: frozenset[int] = frozenset()

    def evict(self, block_id: int) -> None:
        if block_id not in self.spared:
            super().evict(block_id)


class _WritesWithoutForgetting(KVCacheGroups):
    __slots__ = ()

    def grow(self, request_id: str, table: Table, token_count: int) -> None:
        caches = [c for c in self.pool.caches if isinstance(c, _EvictionRefusingPrefixCache)]
        last = frozenset(held[-1] for held in table.group_block_ids if held)
        for cache in caches:
            cache.spared = last
        try:
            super().grow(request_id, table, token_count)
        finally:
            for cache in caches:
                cache.spared = frozenset()


class WriteKeepsAKeptKey(KVCacheManager):
    """(k) An append into a block a rollback left partly filled but cached writes in place
    and keeps its key, so a later prompt hits K/V the write changed."""

    prefix_cache_class = _EvictionRefusingPrefixCache
    groups_class = _WritesWithoutForgetting


class TruncateUnsharesTheLastBlock(KVCacheManager):
    """(l) Rollback marks the table as holding only its own blocks, so the next append
    writes into a block it still shares (a fork's) in place, without a copy."""

    def truncate(self, request_id: str, token_count: int) -> ReleasedBlocks:
        released = super().truncate(request_id, token_count)
        table = self._tables[request_id]
        # Room to its last block's end, whoever else holds it.
        table.room = max(0, -token_count % self.block_size - (table.token_ids is not None))
        return released


class _SkipsEarlyWindow(SlidingWindowGroup):
    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return super().skip_target(block_size, computed_tokens + 1)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        return super().next_skip_at(block_size, skipped_blocks) - 1  # the same rule, early


class _SkipsEarly(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        spec.SlidingWindow: _SkipsEarlyWindow,
    }


class SkipsABlockOneStepEarly(KVCacheManager):
    """(m) The window rule off by one: a block goes when (b + 1) * block_size <= L0 - W + 2,
    one token before the last query that reads it."""

    groups_class = _SkipsEarly


class _NeverSkippingWindow(SlidingWindowGroup):
    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return 0


class _NeverSkipping(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        spec.SlidingWindow: _NeverSkippingWindow,
    }


class NeverSkips(KVCacheManager):
    """(n) A windowed group keeps every block, as an allocator without windows does."""

    groups_class = _NeverSkipping


class _SkipsButKeeps(KVCacheGroups):
    __slots__ = ()

    def skip(self, table: Table, group: int, drop: int) -> None:
        freed, _ = self.give_back(table.group_block_ids[group][:drop], group, demote=False)
        self.pool.add_skipped(freed)


class FreesSkippedBlocksButKeepsThem(KVCacheManager):
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
        if self.event_sink is not None:
            self.event_sink(AllBlocksCleared())  # it says it cleared everything
        return dropped


class ResetKeepsTheKeysOfHeldBlocks(KVCacheManager):
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


class IgnoresTheSaltOnLookup(KVCacheManager):
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


class SaltsOnlyTheFirstBlock(KVCacheManager):
    """(r) The salt keys a chain's first block but not the blocks after it, so a later
    block of one tenant's chain is cached where another tenant finds it."""

    prefix_cache_class = _SaltsBlockZeroOnly


class _HoldsUnsalted(BlockPool):
    __slots__ = ()

    def hold(self, block_ids: Iterable[int], group: int) -> list[int]:
        block_ids = list(block_ids)
        cache = self.caches[group]
        for block_id in block_ids:
            key = cache.block_keys[block_id]
            if self.ref_counts[block_id] == 0 and key is not None and key.cache_salt is not None:
                cache.evict(block_id)  # re-cached under no salt: the salt is dropped
                cache.insert(BlockKey(key.parent, key.token_ids, key.hash_value, None), block_id)
        return super().hold(block_ids, group)


class ReviveDropsTheSalt(KVCacheManager):
    """(s) Taking a cached free block back for a prefix hit re-caches it without its salt,
    so an unsalted prompt would hit one tenant's K/V."""

    block_pool_class = _HoldsUnsalted


class _SilentEvictionPool(BlockPool):
    __slots__ = ()

    def evict(self, block_id: int) -> None:
        sink = self.event_sink
        for cache in self.caches:
            cache.event_sink = None
        super().evict(block_id)
        for cache in self.caches:
            cache.event_sink = sink


class EvictsWithoutRemoval(KVCacheManager):
    """(t) Taking a cached free block drops its key but emits no ``BlockRemoved``: a router
    still sends prompts to a prefix the replica lost."""

    block_pool_class = _SilentEvictionPool


class _StoresRefusedKeys(PrefixCache):
    __slots__ = ()

    def insert(self, key: BlockKey, block_id: int) -> None:
        held = self.lookup(key.parent, key.token_ids, key.hash_value, key.cache_salt)
        if held is not None and self.event_sink is not None:
            self.event_sink(self.stored_event(key, block_id))
        super().insert(key, block_id)


class StoresARefusedKey(KVCacheManager):
    """(u) A full block whose key another block caches already is refused, but a
    ``BlockStored`` goes out for it anyway (vLLM #44451's kind: events that disagree with
    the cache)."""

    prefix_cache_class = _StoresRefusedKeys


class _ResetRemovesEachBlock(BlockPool):
    __slots__ = ()

    def reset_caches(self) -> int:
        sink = self.event_sink
        if sink is not None:
            for cache in self.caches:
                for block_id, key in enumerate(cache.block_keys):
                    if key is not None:
                        sink(BlockRemoved(block_id, cache.group))
        self.event_sink = None
        try:
            return super().reset_caches()
        finally:
            self.event_sink = sink


class ResetRemovesEachBlock(KVCacheManager):
    """(v) ``reset_prefix_cache`` reports a ``BlockRemoved`` per cached block instead of
    the one ``AllBlocksCleared``: the router's view ends right, the stream is not the
    specified one."""

    block_pool_class = _ResetRemovesEachBlock


PLANTED_BUGS: list[type[KVCacheManager]] = [
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
    WriteKeepsAKeptKey,
    TruncateUnsharesTheLastBlock,
    ResetKeepsTheKeysOfHeldBlocks,
    IgnoresTheSaltOnLookup,
    SaltsOnlyTheFirstBlock,
    ReviveDropsTheSalt,
    EvictsWithoutRemoval,
    StoresARefusedKey,
    ResetRemovesEachBlock,
]

# The bugs of the window rule: they live where only a pool with a sliding window goes, so
# the windowed state machine and the window walk of the bounded checker must catch them.
WINDOW_PLANTED_BUGS: list[type[KVCacheManager]] = [
    SkipsABlockOneStepEarly,
    NeverSkips,
    FreesSkippedBlocksButKeepsThem,
]

# -- the engine's queries --------------------------------------------------------------
# Bugs in what chunked prefill and speculative rollback ask the manager. The lockstep
# machine must catch them; the bounded checker walks the allocating operations only.


class RollbackReportsCachedBlocksAsFreed(KVCacheManager):
    """(m) ``truncate`` reports every dropped block as freed, cached ones too, so the engine
    would poison K/V a later prefix hit takes back."""

    def truncate(self, request_id: str, token_count: int) -> ReleasedBlocks:
        released = super().truncate(request_id, token_count)
        freed = released.freed_block_ids + released.cached_block_ids
        return ReleasedBlocks(released.block_ids, freed, (), released.stale_slots)


class PrefixQueryCoversTheLastToken(KVCacheManager):
    """(n) ``cached_prefix_tokens`` counts a cached block holding the prompt's last token,
    so a chunked prefill would feed nothing and sample from no logits."""

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        hit = super().cached_prefix_tokens(token_ids, cache_salt)
        ids = tuple(token_ids)
        whole = ids[: hit + self.block_size]
        if len(whole) == len(ids) and len(ids) % self.block_size == 0:
            for block_id in range(self.total_blocks):
                key = self._pool.caches[0].block_keys[block_id]
                if key is not None and key.prefix() == whole:
                    return len(ids)
        return hit


class _ViewsTheFreeQueueOnly(BlockPool):
    __slots__ = ()

    def cache_view(self) -> frozenset[spec.CachedBlock]:
        return frozenset(
            entry for entry in super().cache_view() if entry.block_id in self.cached_free
        )


class CacheViewMissesHeldBlocks(KVCacheManager):
    """(w) ``cache_view`` lists the cached free queue only: a router resyncing from it
    forgets every prefix running requests hold, the hits it should route to most."""

    block_pool_class = _ViewsTheFreeQueueOnly


QUERY_BUGS: list[type[KVCacheManager]] = [
    RollbackReportsCachedBlocksAsFreed,
    PrefixQueryCoversTheLastToken,
    CacheViewMissesHeldBlocks,
]

# -- the all-groups step API -------------------------------------------------------------
# Bugs in what one engine step asks at once; the windowed lockstep machine must catch them
# (it has several groups, windows and forks).


class StepSlotsIgnoreTheWindow(KVCacheManager):
    """``allocate`` and ``append`` compute a windowed group's slots as if it skipped
    nothing, so a step would write K/V through the wrong block."""

    def _appended(
        self, request_id: str, table: Table, new_tokens: int, cached_tokens: int
    ) -> AppendedSlots:
        step = super()._appended(request_id, table, new_tokens, cached_tokens)
        end = table.token_count
        slots = tuple(
            tuple(
                held[min(p // self.block_size, len(held) - 1)] * self.block_size
                + p % self.block_size
                for p in range(end - new_tokens, end)
            )
            for held in table.group_block_ids
        )
        return step._replace(slots=slots)


class RollbackCallsSharedSlotsStale(KVCacheManager):
    """``truncate`` reports the rolled-back slots of a kept last block a fork still holds,
    so the engine would poison K/V the other request reads."""

    def truncate(self, request_id: str, token_count: int) -> ReleasedBlocks:
        before = self.tables(request_id) if request_id in self._tables else ()
        released = super().truncate(request_id, token_count)
        stale = []
        after = self.tables(request_id) if before else ()
        for table, reported, kept in zip(before, released.stale_slots, after, strict=True):
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


STEP_API_BUGS: list[type[KVCacheManager]] = [
    StepSlotsIgnoreTheWindow,
    RollbackCallsSharedSlotsStale,
]


# -- the host tier ----------------------------------------------------------------------
# Bugs of preemption by swap; the host-tier lockstep machine and the host-tier bounded
# walk must both catch each (tests/allocator/test_host_tier_state_machine.py,
# test_bounded.py's HOST_SHORTEST_FAILURES).


class _LeaksOnTakeHostTier(HostTier):
    __slots__ = ()

    def take_copies(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[GroupBlock]]:
        out, back, copied = super().take_copies()
        if back and self.free:
            self.free.pop()  # the last host block a copy in read never comes back
        return out, back, copied


class LeaksAHostBlockOnSwapIn(KVCacheManager):
    """A host block a swap-in read is not freed when its copy is taken: the host tier
    shrinks by a block per swap-in."""

    host_tier_class = _LeaksOnTakeHostTier


class _ForgetsCopiesOutHostTier(HostTier):
    __slots__ = ()

    def copy_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.pending_out += zip(device_ids, host_ids, strict=True)  # no block marked read


class ReusesABlockBeforeItsCopyOut(KVCacheManager):
    """A swapped-out block goes straight to the free queue, so the next allocation may
    overwrite it before its copy to the host is made (vLLM #47653)."""

    host_tier_class = _ForgetsCopiesOutHostTier


class SwapInForgetsTheOtherHolder(KVCacheManager):
    """A swap-in that restores sharing: a block whose original is still held by the
    request's fork sibling gets that original back, without a reference for the
    swapped-in request, so the sibling's release frees a block still in use."""

    def __init__(self, total_blocks: int, block_size: int = 16, **kwargs: Any) -> None:
        super().__init__(total_blocks, block_size, **kwargs)
        self._origins: dict[str, list[list[int]]] = {}

    def swap_out(self, request_id: str) -> ReleasedBlocks:
        origins = [list(held) for held in self._table(request_id).group_block_ids]
        swapped = super().swap_out(request_id)
        self._origins[request_id] = origins
        return swapped

    def swap_in(self, request_id: str) -> tuple[spec.RequestBlockTable, ...]:
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
                    pool.group_used_blocks[0] -= 1
                    host = self._host
                    host.free.extend(h for h, d in host.pending_in if d == fresh)
                    host.pending_in = [(h, d) for h, d in host.pending_in if d != fresh]
        table.changed()
        return self.tables(request_id)


class _CopiesHostHitsInUnsalted(PrefixHits):
    __slots__ = ()

    def take_host_hits(
        self, group: int, host_hits: list[tuple[int, int]], keys: list[BlockKey]
    ) -> list[int]:
        unsalted = [BlockKey(k.parent, k.token_ids, k.hash_value, None) for k in keys]
        return super().take_host_hits(group, host_hits, unsalted)


class RevivesADemotedPrefixUnsalted(KVCacheManager):
    """A prefix hit on the host caches the device block it copies the prefix back into
    under its tokens without the salt: another tenant's prompt then hits it."""

    prefix_hits_class = _CopiesHostHitsInUnsalted


HOST_TIER_BUGS: list[type[KVCacheManager]] = [
    LeaksAHostBlockOnSwapIn,
    ReusesABlockBeforeItsCopyOut,
    SwapInForgetsTheOtherHolder,
    RevivesADemotedPrefixUnsalted,
]


# -- refusals ---------------------------------------------------------------------------
# Bugs in what a call refuses, and in which order: lockstep draws malformed arguments of
# every kind (non-iterables, iterables that are not sequences, ids of the wrong type) and
# compares the errors, so each must fail it.


class TakesAnyIterableAsTokenIds(KVCacheManager):
    """(w) ``allocate`` takes any iterable but a ``str`` as token ids (a set, a dict's
    keys), where the spec takes a sequence only and refuses the rest as a count: impl
    admits what the spec refuses, in an order a set does not have."""

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        drawn: object = tokens  # typed as the API's; lockstep passes anything
        if isinstance(drawn, Iterable) and not isinstance(drawn, Sequence):
            tokens = tuple(drawn)
        return super().allocate(request_id, tokens, cache_salt)


class ChecksTheTokensBeforeTheId(KVCacheManager):
    """(x) ``allocate`` refuses malformed tokens before a duplicate request id (issue 33's
    difference, the other way round): the same call, another error."""

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        if spec.is_token_ids(tokens):
            spec.check_token_ids(tuple(tokens))
        else:
            spec.check_token_count(tokens)
        return super().allocate(request_id, tokens, cache_salt)


# TakesAnyIterableAsTokenIds is caught by a scenario over every odd value
# (tests/allocator/test_bad_input.py): the derandomized machine draws a set as a prompt too
# rarely to be relied on.
REFUSAL_BUGS: list[type[KVCacheManager]] = [ChecksTheTokensBeforeTheId]
