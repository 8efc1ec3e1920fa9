"""Planted producer bugs of the KV event stream, in impl: each sends a stream a router
would be misled by, and each is caught by the stream checks of lockstep and the bounded
walk (``tests.support.stream_check``), before the event-for-event comparison with the
spec would. The skipped sequence number is the publisher's (``impl.event_publisher``),
which only lockstep sees: a bounded-walk transition publishes one batch at most.
"""

from collections.abc import Sequence
from typing import Any

from impl import AppendedSlots, KVCacheManager
from impl.block_pool import BlockPool
from impl.event_publisher import EventPublisher
from spec import BlockRemoved, BlockStored, ReleasedBlocks
from spec.event_stream import EventBatch, KeyStored, StreamEvent


class StoresBeforeTheWrite(KVCacheManager):
    """vLLM #41838's class: a key published before its block's K/V is all written; here
    the block an ``append`` of token ids leaves partly filled is announced as if full,
    with the tokens written so far."""

    def append(self, request_id: str, tokens: int | Sequence[int] = 1) -> AppendedSlots:
        slots = super().append(request_id, tokens)
        state = self.to_spec()
        token_ids = state.token_ids.get(request_id, ())
        (block_ids, *_) = (table.block_ids for table in self.tables(request_id))
        if len(token_ids) % self.block_size and self.event_sink is not None:
            salt = state.cache_salts.get(request_id)
            self.event_sink(BlockStored(block_ids[-1], 0, None, token_ids, salt))
        return slots


class RemovesWhileACopyRemains(KVCacheManager):
    """vLLM #55092's class: a remove per holder, so a release that lets go of a cached
    block another request still holds reports the key gone while it stays cached."""

    def release(self, request_id: str) -> ReleasedBlocks:
        held = self.tables(request_id)[0].block_ids if request_id in self.to_spec().tables else ()
        released = super().release(request_id)
        state = self.to_spec()
        cached = set(state.group_caches[0].values())
        for block_id in held:
            if block_id in state.ref_counts and block_id in cached and self.event_sink:
                self.event_sink(BlockRemoved(block_id, 0))
        return released


class _ResetsSilently(BlockPool):
    __slots__ = ()

    def reset_caches(self) -> int:
        sink, self.event_sink = self.event_sink, None
        try:
            return super().reset_caches()
        finally:
            self.event_sink = sink


class ForgetsTheClearOnReset(KVCacheManager):
    """TensorRT-LLM #17145's class: a reset that clears the caches and tells no consumer."""

    block_pool_class = _ResetsSilently


class SkipsASequenceNumber(EventPublisher):
    """A publisher that numbers its third batch one past the next number."""

    def end_step(self) -> tuple[EventBatch, ...]:
        batches = super().end_step()
        if [batch.seq for batch in batches] != [2]:
            return batches
        self.next_seq += 1
        return (EventBatch(3, batches[0].events),)


class StoresChildrenFirst(EventPublisher):
    """A publisher that sends a step's stores longest key first (as one that forwards a
    release's demotions in release order, last block first, would): a child's store comes
    before its parent's, and a radix-tree consumer (Dynamo's) drops it."""

    def _in_order(self, pending: list[tuple[int, StreamEvent]]) -> tuple[StreamEvent, ...]:
        ordered = super()._in_order(pending)
        stores = [event for event in ordered if isinstance(event, KeyStored)]
        others = [event for event in ordered if not isinstance(event, KeyStored)]
        return (*others, *reversed(stores))


class PublishesNoHostKeys(KVCacheManager):
    """A host prefix cache that tells no consumer what it holds: demoted prefixes a
    router could send requests to (medium ``"CPU"``) never reach the stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # Any: the manager's own
        kwargs.pop("host_event_sink", None)
        super().__init__(*args, **kwargs)
