"""Deliberately broken state groups (``spec.kinds``): each must make the hybrid lockstep
machine and the bounded walk fail. Each is the smallest change to ``KVCacheManager`` that
plants one class of bug the trackers show in hybrid allocators (issue 34)."""

from collections.abc import Mapping
from typing import ClassVar

from impl import KVCacheManager
from impl.group_kinds import IMPL_KINDS, FullAttentionGroup, HitPart, RecurrentStateGroup
from impl.groups import KVCacheGroups
from impl.prefix_cache import BlockKey, PrefixCache
from impl.tables import Table
from spec import RecurrentState


class _RestoresAnEarlierCheckpointGroup(RecurrentStateGroup):
    __slots__ = ()

    def hit_part(
        self,
        block_size: int,
        found: list[int | None],
        on_host: dict[int, int],
        run: list[int],
        hit_blocks: int,
    ) -> HitPart | None:
        earlier = [b for b in found[:hit_blocks] if b is not None]
        return (earlier[-1:], []) if earlier else None


class _RestoresAnEarlierCheckpoint(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        RecurrentState: _RestoresAnEarlierCheckpointGroup,
    }


class HitsPastTheLastCheckpoint(KVCacheManager):
    """A hit past a boundary the state cannot be rewound to (vllm #57128, #53912, #50630 as
    issue 34 cites them): the state group accepts a hit of h with any checkpoint at or
    before h, and restores that one."""

    groups_class = _RestoresAnEarlierCheckpoint


class _KeysInIntervals(RecurrentStateGroup):
    __slots__ = ()

    def checkpoint_key(self, table: Table, token_count: int, cache: PrefixCache) -> BlockKey | None:
        key = super().checkpoint_key(table, token_count, cache)
        if key is None or table.keys is None:
            return key
        return table.keys[table.token_count // self.interval - 1]


class _KeysCheckpointsInIntervals(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        RecurrentState: _KeysInIntervals,
    }


class CheckpointKeyedInIntervals(KVCacheManager):
    """A checkpoint indexed in the wrong units (vllm #55600, #53142): its key is the prefix
    of ``L0 // interval`` blocks, not ``L0 // block_size``, so with an interval of two
    blocks a state after L0 tokens is cached as the state after L0 / 2."""

    groups_class = _KeysCheckpointsInIntervals


class _TakesTheLongestCheckpointGroup(RecurrentStateGroup):
    __slots__ = ()

    def hit_part(
        self,
        block_size: int,
        found: list[int | None],
        on_host: dict[int, int],
        run: list[int],
        hit_blocks: int,
    ) -> HitPart | None:
        return [b for b in found if b is not None][-1:], []


class _TakesTheLongestCheckpoint(KVCacheGroups):
    __slots__ = ()
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = {
        **IMPL_KINDS,
        RecurrentState: _TakesTheLongestCheckpointGroup,
    }


class CommonHitIsTheMax(KVCacheManager):
    """Per-group hits that disagree (vllm #45614, #46453): the common hit is the attention
    groups' alone (the max over groups), and the state group restores its own longest
    checkpoint, or none."""

    groups_class = _TakesTheLongestCheckpoint


class _FreesTheCheckpoint(KVCacheGroups):
    __slots__ = ()

    def copy_before_write(self, held: list[int], destination: int, group: int) -> None:
        source = held[-1]
        super().copy_before_write(held, destination, group)
        pool = self.pool
        if source in pool.cached_free:
            del pool.cached_free[source]
            pool.evict(source)
            pool.free.append(source)


class FreesTheCheckpointBeforeItsCopy(KVCacheManager):
    """A state slot freed while a checkpoint still reads it: the write rule gives the
    checkpoint's block back as a free block (its key dropped) while its copy is pending,
    so the next allocation may take it, and a poisoned pool fills it before the copy."""

    groups_class = _FreesTheCheckpoint


STATE_PLANTED_BUGS: list[type[KVCacheManager]] = [
    HitsPastTheLastCheckpoint,
    CheckpointKeyedInIntervals,
    CommonHitIsTheMax,
    FreesTheCheckpointBeforeItsCopy,
]
