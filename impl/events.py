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
    """The events emitted since the last delivery. ``emit`` is ``None`` without a sink, so
    the parts build no event at all."""

    __slots__ = ("emit", "events", "sink")

    def __init__(self, event_sink: EventSink | None) -> None:
        self.sink = event_sink
        self.events: list[KVCacheEvent] = []
        self.emit = None if event_sink is None else self.events.append

    def delivered(self, result: T) -> T:
        """``result``, once the pending events are offered to the sink (``deliver_events``)."""
        if self.events and self.sink is not None:
            events = self.events.copy()
            self.events.clear()  # first: a sink calling the manager delivers that call's own
            deliver_events(self.sink, events)
        return result
