"""``EventPublisher``: impl's producer of the KV event stream a router consumes
(``spec.event_stream``), from a manager's block-keyed events (``spec.events``).

It is the manager's event sinks: ``record`` for the device caches' events (medium
``"GPU"``), ``record_host`` for the host prefix cache's (``"CPU"``, the manager's
``host_event_sink``). A cache holds a key in one block, so each ``BlockStored`` or
``BlockRemoved`` is one key entering or leaving a (group, medium): one ``KeyStored`` or
``KeyRemoved``, made as it comes. ``end_step`` publishes what the step gathered as one
``EventBatch`` numbered one past the last (none for a step without events), as the step's
net changes: removes, then stores parents first (a release demotes a request's blocks to
the host last block first, and a radix-tree consumer drops a store whose parent it has
not seen). It
remembers each cached block's key and hash, so a store costs one block hash
(O(block_size)) when its parent block is cached, O(prefix) for a first block or an
orphan. Lockstep and the bounded walk check its batches against the spec at every step.
"""

from spec import AllBlocksCleared, BlockRemoved, BlockStored, CacheKey, KVCacheEvent
from spec.block_hash import compute_external_hash
from spec.event_stream import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    EventBatch,
    KeyRemoved,
    KeyStored,
    PresentKey,
    StreamEvent,
    compute_key_stored_after,
    compute_parent_hash,
    compute_resync_events,
)
from spec.events import EventReplayError

# Where a key is cached: (medium, group, block id).
Place = tuple[str, int, int]


class EventPublisher:
    """Numbered batches of stream events from the events of a pool of ``block_size``-token
    blocks; the first batch is numbered ``first_seq``."""

    __slots__ = ("_cached", "_hashes", "_pending", "block_size", "next_seq")

    def __init__(self, block_size: int, first_seq: int = 0) -> None:
        self.block_size = block_size
        self.next_seq = first_seq
        # Each cached block's key and hash (the parent hash of its child's store).
        self._cached: dict[Place, tuple[CacheKey, bytes]] = {}
        # Each key cached somewhere: its hash and how many places hold it.
        # NOTE: a store without a parent block (a first block, or an orphan: a demoted
        # block arrives before its parent's demotion, a release demoting last block first)
        # finds its parent's hash here when any medium caches the parent, instead of
        # hashing its whole prefix block by block (a 64-block prefix: 64 SHA-256 calls).
        self._hashes: dict[CacheKey, tuple[bytes, int]] = {}
        # The step's events, each with the length of its key (0 but for a store).
        self._pending: list[tuple[int, StreamEvent]] = []

    def record(self, event: KVCacheEvent) -> None:
        """The device caches' event sink."""
        self._translate(MEDIUM_GPU, event)

    def record_host(self, event: KVCacheEvent) -> None:
        """The host prefix cache's event sink."""
        self._translate(MEDIUM_CPU, event)

    def _translate(self, medium: str, event: KVCacheEvent) -> None:
        """``spec.EventReplayError`` for an event the blocks it remembers contradict."""
        if isinstance(event, AllBlocksCleared):
            self._cached.clear()
            self._hashes.clear()
            self._pending.append((0, event))
            return
        place = (medium, event.group, event.block_id)
        if isinstance(event, BlockRemoved):
            if place not in self._cached:
                raise EventReplayError(f"{event} ({medium}): the block caches nothing")
            key, own = self._cached.pop(place)
            _, places = self._hashes[key]
            if places == 1:
                del self._hashes[key]
            else:
                self._hashes[key] = (own, places - 1)
            removed = KeyRemoved(event.group, medium, compute_external_hash(own))
            self._pending.append((0, removed))
            return
        key, parent_hash = self._key_of(medium, event)
        present = PresentKey(event.group, medium, key)
        stored, own = compute_key_stored_after(present, parent_hash, self.block_size)
        self._cached[place] = (key, own)
        self._hashes[key] = (own, self._hashes.get(key, (own, 0))[1] + 1)
        self._pending.append((len(key.token_ids), stored))

    def _key_of(self, medium: str, event: BlockStored) -> tuple[CacheKey, bytes | None]:
        """The key ``event`` stores and its parent prefix's hash."""
        if event.parent_block_id is None:
            key = CacheKey(event.cache_salt, event.token_ids)
            prefix = CacheKey(key.cache_salt, key.token_ids[: -self.block_size])
            known = self._hashes.get(prefix) if prefix.token_ids else None
            if known is not None:
                return key, known[0]
            return key, compute_parent_hash(key, self.block_size)
        cached = self._cached.get((medium, event.group, event.parent_block_id))
        if cached is None:
            raise EventReplayError(f"{event} ({medium}): its parent block caches nothing")
        parent_key, parent_hash = cached
        return CacheKey(parent_key.cache_salt, parent_key.token_ids + event.token_ids), parent_hash

    def end_step(self) -> tuple[EventBatch, ...]:
        """The step is over: its events as one batch, numbered next (none if none)."""
        if not self._pending:
            return ()
        batch = EventBatch(self.next_seq, self._in_order(self._pending))
        self._pending.clear()
        self.next_seq += 1
        return (batch,)

    def _in_order(self, pending: list[tuple[int, StreamEvent]]) -> tuple[StreamEvent, ...]:
        """The order a step's events are published in: ``parents_first``."""
        return parents_first(pending)

    def present_keys(self) -> frozenset[PresentKey]:
        """The keys the events so far leave present."""
        return frozenset(
            PresentKey(group, medium, key) for (medium, group, _), (key, _) in self._cached.items()
        )

    def resync(self) -> tuple[EventBatch, ...]:
        """The step's events, then ``AllBlocksCleared`` and a store of every present key in
        a batch of their own: what a producer sends when its consumers may have lost
        track."""
        batches = self.end_step()
        resync = compute_resync_events(self.present_keys(), self.block_size)
        self._pending.extend((0, event) for event in resync)  # in order already
        return batches + self.end_step()


def parents_first(pending: list[tuple[int, StreamEvent]]) -> tuple[StreamEvent, ...]:
    """A step's events as its net changes, between its ``AllBlocksCleared``s: the removes
    of keys present before and gone after, in order, then the stores of keys absent before
    and present after, by key length, parents first. A key stored and removed again
    within the step (a demotion whose host block the next demotion takes) is left out."""
    out: list[StreamEvent] = []
    segment: list[tuple[int, StreamEvent]] = []
    for length, event in [*pending, (0, AllBlocksCleared())]:
        if not isinstance(event, AllBlocksCleared):
            segment.append((length, event))
            continue
        out.extend(_net(segment))
        out.append(event)
        segment.clear()
    return tuple(out[:-1])


def _net(segment: list[tuple[int, StreamEvent]]) -> list[StreamEvent]:
    """Removes then stores, of the keys whose presence ``segment`` changes (a key's events
    alternate: its first says whether it was present, its last whether it is)."""
    first: dict[tuple[int, str, int], StreamEvent] = {}
    last: dict[tuple[int, str, int], tuple[int, StreamEvent]] = {}
    for length, event in segment:
        assert not isinstance(event, AllBlocksCleared)
        place = (event.group, event.medium, event.block_hash)
        first.setdefault(place, event)
        last.pop(place, None)
        last[place] = (length, event)
    changed = [
        (length, event)
        for place, (length, event) in last.items()
        if type(first[place]) is type(event)
    ]
    removes = [event for _, event in changed if isinstance(event, KeyRemoved)]
    stores = sorted(
        ((length, event) for length, event in changed if isinstance(event, KeyStored)),
        key=lambda item: item[0],
    )
    return [*removes, *(event for _, event in stores)]
