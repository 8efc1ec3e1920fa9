"""Design bugs for the metamorphic relations to catch: rules that spec and impl could both
follow (so lockstep, which compares them, cannot see them), each planted in impl, where
``tests/allocator/test_metamorphic.py`` runs the relation it breaks on impl alone.

- ``HoldsDemotedBlocksInFlight``: the host prefix cache as it was before issue 49: the
  blocks a release frees are demoted in release order while the host has room, and each
  demoted block is held in flight until its copy is taken, so a chain's undemoted head
  reaches the cached free queue first and is evicted first (``HostTierAddsHits``).
- ``FlushesTheCacheWhenOutOfFreeBlocks``: an allocation the free queue cannot serve evicts
  every cached free block at once, not only as many as it needs (``LargerPoolKeepsHits``:
  the larger pool flushes later, after the smaller one cached a prompt again).
- ``RollbackUncachesASharedBlock``: the rollback rule before issue 49: a cached block a
  rollback cuts into loses its key whoever holds it (``SaltNeverRaisesHits``: unsalted, a
  second tenant's hit shares the block and loses it).
- ``ForkCopiesTheLastBlockAtOnce``: a fork copies a partly filled last block at once
  instead of on the first write (``ForkReleaseLeavesTheCache``: the copy's block comes
  back at the free queue's tail).
- ``ResetKeepsTheHostKeys``: ``reset_prefix_cache`` forgets the device's keys and not the
  host prefix cache's (``ResetIsAFreshPool``: a prompt still hits on the host).
- ``ResyncWithoutItsClear``: a publisher's resync stores every present key without the
  ``AllBlocksCleared`` first (``ConsumersMachine``: a consumer that missed a remove keeps
  the key).
"""

from impl import KVCacheManager
from impl.block_pool import BlockPool
from impl.event_publisher import EventPublisher
from impl.groups import KVCacheGroups
from impl.host_tier import GroupBlock, HostTier
from impl.prefix_cache import PrefixCache
from impl.tables import Table
from spec import ReleasedBlocks
from spec.event_stream import EventBatch


class _DemotesInFlight(HostTier):
    __slots__ = ()

    def write_through(self, block_ids: list[int], group: int, cache: PrefixCache) -> None:
        host_cache = self.caches[group]
        for block_id in block_ids:
            key = cache.block_keys[block_id]
            if key is not None and host_cache.find(key) is None and self.free_blocks:
                self.demote(block_id, group, key)

    def keep_in_flight(
        self, block_ids: list[int], group: int, cache: PrefixCache, *, demote: bool
    ) -> list[int]:
        before = set(self.demoting)
        rest = super().keep_in_flight(block_ids, group, cache, demote=demote)
        held = [block_id for block_id in rest if block_id in self.demoting.keys() - before]
        for block_id in held:  # pinned as a swap-out's copy pins its block
            del self.demoting[block_id]
            self.copying_out[block_id] = self.copying_out.get(block_id, 0) + 1
            self.in_flight[block_id] = group
        return [block_id for block_id in rest if block_id not in held]


class HoldsDemotedBlocksInFlight(KVCacheManager):
    host_tier_class = _DemotesInFlight


class _Flushes(BlockPool):
    __slots__ = ()

    def take(self, count: int, group: int) -> list[int]:
        if count > len(self.free) and self.cached_free:
            for block_id in self.cached_free:
                self.evict(block_id)
                if self.on_evict is not None:
                    self.on_evict(block_id)
            self.evictions += len(self.cached_free)
            self.free.extend(self.cached_free)
            self.cached_free.clear()
        return super().take(count, group)


class FlushesTheCacheWhenOutOfFreeBlocks(KVCacheManager):
    block_pool_class = _Flushes


class _UncachesOnRollback(KVCacheGroups):
    __slots__ = ()

    def truncate(self, table: Table, token_count: int) -> ReleasedBlocks:
        released = super().truncate(table, token_count)
        if token_count % self.block_size:
            for group, held in enumerate(table.group_block_ids):
                cache = self.pool.caches[group]
                if held and cache.block_keys[held[-1]] is not None:
                    cache.evict(held[-1])
        return released


class RollbackUncachesASharedBlock(KVCacheManager):
    groups_class = _UncachesOnRollback


class _CopiesAtFork(KVCacheGroups):
    __slots__ = ()

    def fork(self, parent: Table) -> Table:
        child = super().fork(parent)
        pool = self.pool
        if parent.token_count % self.block_size and pool.free_blocks >= len(self.groups):
            for group, held in enumerate(child.group_block_ids):
                pool.copy_last_block(held, pool.take(1, group)[0])
            child.changed()
            self.set_room(parent)
            self.set_room(child)
        return child


class ForkCopiesTheLastBlockAtOnce(KVCacheManager):
    groups_class = _CopiesAtFork


class _KeepsHostKeys(HostTier):
    __slots__ = ()

    def reset(self) -> list[GroupBlock]:
        return []


class ResetKeepsTheHostKeys(KVCacheManager):
    host_tier_class = _KeepsHostKeys


class ResyncWithoutItsClear(EventPublisher):
    __slots__ = ()

    def resync(self) -> tuple[EventBatch, ...]:
        batches = super().resync()
        last = batches[-1]
        return (*batches[:-1], EventBatch(last.seq, last.events[1:]))
