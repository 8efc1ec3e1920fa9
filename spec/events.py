"""KV cache events: the stream a router replays to know which blocks cache which prefixes.

Three records, vLLM's and SGLang's names: ``BlockStored`` (a full block's key entered a
group's prefix cache), ``BlockRemoved`` (a key left it) and ``AllBlocksCleared`` (every key
of every group left at once). The allocator emits them in the order its caches changed;
which transition emits which is stated in ``spec.caching`` (``docs/design.md`` has the
table). Nothing else changes a cache, so nothing else emits: a cached free block a prompt
holds again keeps its key (no event), a key refused because another block of the group
caches it already emits nothing, a block released to the cached free queue keeps its key.

``BlockStored.token_ids`` are the tokens the key adds to its parent's key: a block's own
``block_size`` tokens when ``parent_block_id`` names the block the group caches the
parent prefix in, the whole prefix when the group caches the parent prefix nowhere (a
first block, or one whose parent was evicted, reset, or skipped by a window). So every
event names a key exactly, with no hash to trust.

Delivery: a call's events reach the user's ``event_sink`` after the call is done (here,
the state a transition returns carries them; ``take_events`` drains them), in order, each
offered once. A sink that raises cannot undo or half-do the call: the state is the one
the transition returned, no block leaks, every other event of the call is still offered,
and the sink's first error then reaches the caller (the call's result is lost with it;
``tables`` and ``usage`` tell it). ``impl.events`` delivers so, for impl and spec alike.

``replay_events`` is the router's side: from a view (by default the empty cache) and
events, the view after them, as a set of ``CachedBlock``. Replaying every event from the
start gives exactly the blocks the caches hold now (``get_cached_blocks`` of the state);
lockstep and the bounded walk check it after every step. An event the view contradicts
(a removal of a block it holds no key for, a store onto a keyed block, a key another
block of the group holds, a parent it does not know) raises ``EventReplayError``.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from spec.records import CacheKey


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Block ``block_id`` of KV cache group ``group`` is cached under the key its parent's
    key (``parent_block_id``'s, or none) plus ``token_ids``, under ``cache_salt``."""

    block_id: int
    group: int
    parent_block_id: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Block ``block_id`` of group ``group`` is cached no more: no prompt can hit it."""

    block_id: int
    group: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every group's prefix cache is empty (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class CachedBlock(NamedTuple):
    """One entry of a cache view: a group, a block of it, and the key the block caches."""

    group: int
    block_id: int
    key: CacheKey


class EventReplayError(ValueError):
    """An event that contradicts the view it is replayed onto."""


def replay_events(
    events: Iterable[KVCacheEvent], view: frozenset[CachedBlock] = frozenset()
) -> frozenset[CachedBlock]:
    """The cache view after ``events``, replayed in order onto ``view``; raises
    ``EventReplayError`` at the first event ``view`` contradicts. O(events + view)."""
    keys = {(entry.group, entry.block_id): entry.key for entry in view}
    # The same view the other way round: which block of a group caches a key.
    holders = {(entry.group, entry.key): entry.block_id for entry in view}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            keys.clear()
            holders.clear()
        elif isinstance(event, BlockRemoved):
            key = keys.pop((event.group, event.block_id), None)
            if key is None:
                raise EventReplayError(
                    f"BlockRemoved of block {event.block_id} in group {event.group}, "
                    "which the view holds no key for"
                )
            del holders[event.group, key]
        else:
            key = _stored_key(keys, holders, event)
            keys[event.group, event.block_id] = key
            holders[event.group, key] = event.block_id
    return frozenset(CachedBlock(group, block_id, key) for (group, block_id), key in keys.items())


def _stored_key(
    keys: dict[tuple[int, int], CacheKey],
    holders: dict[tuple[int, CacheKey], int],
    event: BlockStored,
) -> CacheKey:
    """The key ``event`` stores, checked against the view (``keys`` and ``holders``)."""
    where = f"BlockStored of block {event.block_id} in group {event.group}"
    if (event.group, event.block_id) in keys:
        raise EventReplayError(f"{where}, which the view holds a key for already")
    prefix: tuple[int, ...] = ()
    if event.parent_block_id is not None:
        parent = keys.get((event.group, event.parent_block_id))
        if parent is None:
            raise EventReplayError(
                f"{where} names parent block {event.parent_block_id}, which caches no key"
            )
        if parent.cache_salt != event.cache_salt:
            raise EventReplayError(
                f"{where}: salt {event.cache_salt!r}, parent block "
                f"{event.parent_block_id}'s {parent.cache_salt!r}"
            )
        prefix = parent.token_ids
    key = CacheKey(event.cache_salt, prefix + event.token_ids)
    holder = holders.get((event.group, key))
    if holder is not None:
        raise EventReplayError(f"{where}: block {holder} caches that key already")
    return key
