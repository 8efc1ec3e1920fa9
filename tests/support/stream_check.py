"""The stream checks lockstep and the bounded walk make after every step: what a publisher
sends of the spec's events (``spec.event_stream.compute_state_events``) and what impl's
``EventPublisher`` sends of impl's are each a correct stream of the spec's step
(``spec.event_consumers.check_stream_step``: batch numbers, the reset's clear, the hash
rule, and both consumer models, the set and the count, holding exactly the spec's keys).
"""

from spec import AllocatorState, get_cached_blocks
from spec.event_consumers import StreamView, check_stream_step, get_stream_step, start_stream_view
from spec.event_stream import (
    BlockKeys,
    EventBatch,
    compute_state_events,
    get_host_keys,
    get_present_keys,
)


class SpecPublisher:
    """A publisher of the spec's events from ``state`` on (``None``: a pool of
    ``block_size``-token blocks that caches nothing yet), each step's as one batch."""

    def __init__(self, block_size: int, state: AllocatorState | None = None) -> None:
        cached = frozenset() if state is None else get_cached_blocks(state)
        self.blocks = BlockKeys(block_size, cached)
        self.host_keys = frozenset() if state is None else get_host_keys(state)
        self.next_seq = 0

    def publish(self, state: AllocatorState) -> tuple[EventBatch, ...]:
        """The batches of the step that left ``state`` (read before ``take_events``)."""
        self.blocks, events = compute_state_events(self.blocks, self.host_keys, state)
        self.host_keys = get_host_keys(state)
        if not events:
            return ()
        self.next_seq += 1
        return (EventBatch(self.next_seq - 1, events),)


class StreamChecker:
    """A consumer of one stream that knows ``state``'s keys (``None``: none); ``check``
    raises ``spec.event_stream.StreamError`` at the first step the stream gets wrong."""

    def __init__(self, block_size: int, state: AllocatorState | None = None) -> None:
        keys = frozenset() if state is None else get_present_keys(state)
        self.view: StreamView = start_stream_view(keys, block_size)

    def check(self, state: AllocatorState, batches: tuple[EventBatch, ...], where: str) -> None:
        """The batches of the step that left ``state`` (read before ``take_events``)."""
        step = get_stream_step(state)
        self.view = check_stream_step(self.view, step, batches, state.block_size, where)
