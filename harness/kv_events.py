"""The KV cache events of a run, as a router would receive them: recorded, written, read back.

``KVEventLog`` is a manager's ``event_sink`` (``spec.events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) that stamps each event with the engine step it
happened in; ``write_events`` writes the log as JSON lines, one object per event, and
``read_events`` reads such a file back into the spec's records, so
``spec.replay_events`` can rebuild the router's view of the cache from it.

Not the engine's observer (``harness.runtime.events``): that hears of steps, forks and
preemptions and reads the manager; this hears of cache keys and knows nothing else.
"""

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from impl.prefix_cache import EventSink
from spec import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class KVEventLog:
    """Every event handed to ``record``, with the step ``step_of()`` said it was in."""

    __slots__ = ("events", "step_of")

    def __init__(self) -> None:
        self.events: list[tuple[int, KVCacheEvent]] = []
        # Until an engine is followed, everything happens before its first step.
        self.step_of: Callable[[], int] = lambda: 0

    def record(self, event: KVCacheEvent) -> None:
        """The sink: keep ``event`` with the current step."""
        self.events.append((self.step_of(), event))

    @property
    def host_sink(self) -> EventSink | None:
        """The host prefix cache's sink: none for a file (its lines name no medium)."""
        return None


def event_json(step: int, event: KVCacheEvent) -> dict[str, object]:
    """One event as the JSON object of its line: its type, the step, then its fields."""
    fields = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in asdict(event).items()
    }
    return {"type": type(event).__name__, "step": step, **fields}


def write_events(path: Path, events: Iterable[tuple[int, KVCacheEvent]]) -> None:
    """Write ``events`` to ``path``, one JSON object per line, in order."""
    with path.open("w", encoding="utf-8") as file:
        for step, event in events:
            file.write(json.dumps(event_json(step, event)) + "\n")


def read_events(path: Path) -> list[tuple[int, KVCacheEvent]]:
    """The (step, event) pairs of a file ``write_events`` wrote; ``ValueError`` naming the
    line of anything else."""
    events: list[tuple[int, KVCacheEvent]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            event_type = EVENT_TYPES[record.pop("type")]
            step = record.pop("step")
            if "token_ids" in record:
                record["token_ids"] = tuple(record["token_ids"])
            events.append((step, event_type(**record)))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path}:{number}: not a KV cache event: {error!r}") from None
    return events
