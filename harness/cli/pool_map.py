"""``--pool-map EVERY``: the block map of the continuous-batching run, printed as it goes.

An engine observer (``harness.runtime.engine.PoolObserver``): the map every ``every``
engine steps and at each preemption, fork and release, each under a title line naming the
event. A request keeps its label for the whole run. Colour only on a terminal and only
without ``NO_COLOR`` (https://no-color.org); the width is the terminal's.
"""

import os
import shutil
from typing import TextIO

from harness.runtime.events import PoolEvent
from impl import KVBlockManager
from impl.block_map import extend_labels, render_block_map, snapshot_pool


def wants_color(stream: TextIO) -> bool:
    """Whether to colour what goes to ``stream``: a terminal, and ``NO_COLOR`` unset or empty."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


class PoolMapPrinter:
    """Prints the pool's block map to ``stream`` at the events worth seeing."""

    __slots__ = ("_color", "_every", "_labels", "_stream", "_width")

    def __init__(self, every: int, stream: TextIO) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self._every = every
        self._stream = stream
        self._color = wants_color(stream)
        self._width = shutil.get_terminal_size().columns
        self._labels: dict[str, str] = {}

    def __call__(self, event: PoolEvent, manager: KVBlockManager) -> None:
        if event.kind == "step" and event.step % self._every:
            return
        pool = snapshot_pool(manager)
        self._labels = extend_labels(self._labels, (table.request_id for table in pool.tables))
        title = f"-- step {event.step}: {event.kind}"
        if event.request_ids:
            title += " " + " -> ".join(event.request_ids)
        map_text = render_block_map(pool, self._labels, width=self._width, color=self._color)
        print(f"{title}\n{map_text}\n", file=self._stream, flush=True)
