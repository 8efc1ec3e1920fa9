"""The relation a router relies on: a consumer fed impl's KV event stream holds exactly the
caches' keys after every step it has caught up on, though batches are lost on the way and
it joins late, recovering by the producer's replay buffer or, when that no longer holds
what it missed, by a resync (``spec.event_consumers``: gaps, replay, resync).

``ConsumersMachine`` drives a ``KVCacheManager`` with a host prefix cache (so the stream
has both media) through the metamorphic relations' workload, its events into impl's
``EventPublisher``, whose batches a replay buffer of 1 to 6 keeps. Two consumers read
them: one subscribed from the start, one that joins at a drawn step; each delivery may
be lost (drawn). A consumer that sees a batch number skip asks the buffer for what it
missed; when the buffer no longer has it, it drops what it knows and the producer
resyncs (``EventPublisher.resync``: a clear and a store of every present key, as
TensorRT-LLM's publisher does). After every step, each consumer that has the newest
batch holds, in the set model and in the count model, exactly the keys of the spec
state ``to_spec`` maps the manager to.
"""

from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import invariant

from impl import KVCacheManager
from impl.event_publisher import EventPublisher
from spec.event_consumers import (
    apply_to_key_counts,
    apply_to_key_set,
    get_counted_keys,
    is_gap,
    replay_batches,
)
from spec.event_stream import EventBatch, StreamKey, compute_stream_key, get_present_keys
from spec.events import AllBlocksCleared
from spec.frozen_map import FrozenMap
from tests.support.metamorphic import Factory, Manager, PairMachine, answer


@dataclass
class Consumer:
    """A router's view of one producer: the set and count models, the last batch it took,
    and whether it waits for a resync (it dropped what it knew)."""

    joins_at: int
    keys: frozenset[StreamKey] = frozenset()
    counts: FrozenMap[StreamKey, int] = field(default_factory=FrozenMap[StreamKey, int])
    last_seq: int | None = None
    joined: bool = False
    awaits_resync: bool = False

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            self.keys = apply_to_key_set(self.keys, event)
            self.counts = apply_to_key_counts(self.counts, event)
        self.last_seq = batch.seq

    def catch_up(self, missed: tuple[EventBatch, ...] | None) -> bool:
        """Apply what the replay buffer answered; ``None`` (it no longer holds them): drop
        everything and wait for a resync. Returns whether it needs one."""
        if missed is None:
            self.keys, self.counts, self.awaits_resync = frozenset(), FrozenMap(), True
            return True
        for batch in missed:
            self.apply(batch)
        return False

    def receive(self, batch: EventBatch, buffer: list[EventBatch]) -> bool:
        """Take ``batch``, first asking ``buffer`` for the batches it missed. Returns
        whether it needs a resync."""
        if self.awaits_resync:
            if not batch.events or not isinstance(batch.events[0], AllBlocksCleared):
                return True  # its resync was lost: it asks again
            self.awaits_resync = False
        elif is_gap(self.last_seq, batch):
            assert self.last_seq is not None
            missed = replay_batches(buffer, self.last_seq + 1)
            if self.catch_up(None if missed is None else missed[: batch.seq - self.last_seq - 1]):
                return True
        self.apply(batch)
        return False


class ConsumersMachine(PairMachine):
    """The workload on one impl pool with a host prefix cache, and its stream's readers."""

    publisher_class: type[EventPublisher] = EventPublisher
    factories = (KVCacheManager,)

    def make_pair(
        self, factory: Factory, shape: tuple[int, int], data: st.DataObject
    ) -> tuple[Manager, Manager]:
        total_blocks, block_size = shape
        self.publisher = self.publisher_class(block_size)
        self.buffer_size = data.draw(st.integers(1, 6), label="replay buffer")
        self.buffer: list[EventBatch] = []
        self.consumers = [Consumer(0), Consumer(data.draw(st.integers(1, 12), label="joins at"))]
        self.steps = 0
        self.data = data
        pool = KVCacheManager(
            total_blocks,
            block_size,
            host_blocks=data.draw(st.integers(1, 4), label="host_blocks"),
            host_prefix_cache=True,
            event_sink=self.publisher.record,
            host_event_sink=self.publisher.record_host,
        )
        return pool, pool

    def step(self, name: str, *args: object) -> None:
        answer(self.pairs[0][0], name, *args)
        self.after(name)
        self.steps += 1
        self.publish(self.publisher.end_step())

    def publish(self, batches: tuple[EventBatch, ...]) -> None:
        """Deliver ``batches`` to every consumer that has joined, each delivery lost or not
        (drawn); a consumer that joins asks the buffer for everything from batch 0."""
        self.buffer = (self.buffer + list(batches))[-self.buffer_size :]
        resync = False
        for consumer in self.consumers:
            if not consumer.joined and self.steps >= consumer.joins_at:
                consumer.joined = True
                consumer.last_seq = -1  # it wants every batch from 0 on
                resync |= consumer.catch_up(replay_batches(self.buffer, 0))
                continue
            if not consumer.joined:
                continue
            for batch in batches:
                if not self.data.draw(st.booleans(), label="delivered"):
                    continue
                resync |= consumer.receive(batch, self.buffer)
        if resync:
            self.publish(self.publisher.resync())

    @invariant()
    def consumers_hold_the_caches_keys(self) -> None:
        if not hasattr(self, "publisher"):
            return
        state = self.pairs[0][0].to_spec()
        expected = {compute_stream_key(p, state.block_size) for p in get_present_keys(state)}
        newest = self.buffer[-1].seq if self.buffer else None
        for index, consumer in enumerate(self.consumers):
            if not consumer.joined or consumer.last_seq != (-1 if newest is None else newest):
                continue
            assert consumer.keys == expected, (
                f"consumer {index} (set model) holds {len(consumer.keys)} keys, the caches "
                f"{len(expected)}: extra {sorted(consumer.keys - expected)[:3]}, missing "
                f"{sorted(expected - consumer.keys)[:3]}"
            )
            assert get_counted_keys(consumer.counts) == expected, f"consumer {index} (count model)"
