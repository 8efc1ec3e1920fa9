"""The KV cache events of the call in progress, and their delivery once it is done.

The parts of ``impl.manager.KVCacheManager`` emit events (``spec.events``) into
``PendingEvents.emit`` as its caches change, in the middle of a call; the manager hands
them to the user's ``event_sink`` when the call has changed everything it changes
(``delivered``), so a sink that raises cannot leave a call half done: the contract is
stated in ``spec.events`` ("Delivery"). ``SpecBackedManager`` delivers the spec's events the
same way.
"""

from collections.abc import Iterable
from typing import TypeVar

from impl.prefix_cache import EventSink
from spec import KVCacheEvent

T = TypeVar("T")


def deliver_events(event_sink: EventSink, events: Iterable[KVCacheEvent]) -> None:
    """Offer every event to ``event_sink``, in order; if the sink raised, raise its first
    error once every event has been offered (a note counts the events it raised on). A
    ``BaseException`` that is not an ``Exception`` (Ctrl-C) stops the delivery at once."""
    first: Exception | None = None
    failures = offered = 0
    for event in events:
        offered += 1
        try:
            event_sink(event)
        except Exception as error:
            failures += 1
            if first is None:
                first = error
    if first is not None:
        if failures > 1:
            first.add_note(f"the event sink raised on {failures} of the call's {offered} events")
        raise first


class PendingEvents:
    """The events emitted since the last delivery: the device caches' (``emit``, for
    ``event_sink``) and the host prefix cache's (``emit_host``, for ``host_event_sink``).
    An ``emit`` is ``None`` without its sink, so the parts build no event at all."""

    __slots__ = ("emit", "emit_host", "events", "host_events", "host_sink", "sink")

    def __init__(self, event_sink: EventSink | None, host_event_sink: EventSink | None) -> None:
        self.sink = event_sink
        self.host_sink = host_event_sink
        self.events: list[KVCacheEvent] = []
        self.host_events: list[KVCacheEvent] = []
        self.emit = None if event_sink is None else self.events.append
        self.emit_host = None if host_event_sink is None else self.host_events.append

    def delivered(self, result: T) -> T:
        """``result``, once the pending events are offered to their sinks (the device's,
        then the host's; ``deliver_events``: the first error raised once all are offered)."""
        first: Exception | None = None
        for pending, sink in ((self.events, self.sink), (self.host_events, self.host_sink)):
            if pending and sink is not None:
                events = pending.copy()
                pending.clear()  # first: a sink calling the manager delivers that call's own
                try:
                    deliver_events(sink, events)
                except Exception as error:
                    if first is None:
                        first = error
        if first is not None:
            raise first
        return result
