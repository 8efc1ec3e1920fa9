"""``--pool-map EVERY``: the block map of the continuous-batching run, printed as it goes.

An engine observer (``harness.runtime.engine.PoolObserver``): the map every ``every``
engine steps and at each preemption, swap, fork and release, each under a title line
naming the event; with a host tier, a row of host cells under it (``host_tier_map``). A
request keeps its label for the whole run. Colour only on a terminal and only
without ``NO_COLOR`` (https://no-color.org); the width is the terminal's.
"""

import os
import shutil
from collections.abc import Collection, Mapping
from typing import TextIO

from harness.runtime.events import PoolEvent
from impl import KVCacheManager
from impl.block_map import extend_labels, render_block_map, snapshot_pool
from spec import AllocatorState, RecurrentState


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

    def __call__(self, event: PoolEvent, manager: KVCacheManager) -> None:
        if event.kind == "step" and event.step % self._every:
            return
        state = manager.to_spec()
        pool = snapshot_pool(state)
        self._labels = extend_labels(self._labels, (table.request_id for table in pool.tables))
        title = f"-- step {event.step}: {event.kind}"
        if event.request_ids:
            title += " " + " -> ".join(event.request_ids)
        map_text = render_block_map(pool, self._labels, width=self._width, color=self._color)
        host = host_tier_map(manager, state.host.swapped, self._labels, self._width)
        states = state_group_lines(state, self._labels)
        print(f"{title}\n{map_text}{states}{host}\n", file=self._stream, flush=True)


def state_group_lines(state: AllocatorState, labels: Mapping[str, str]) -> str:
    """A line per recurrent state group under the map: its checkpoint interval, each
    request's running state block (``A:5``) and the checkpoints cached (block ids, with
    the length each holds the state after); empty without a state group."""
    lines = []
    for group, kind in enumerate(state.group_windows):
        if not isinstance(kind, RecurrentState):
            continue
        running = ", ".join(
            f"{labels.get(request_id, request_id)}:{table.block_ids[0]}"
            for request_id, table in sorted(state.group_tables[group].items())
        )
        checkpoints = ", ".join(
            f"{block}@{len(key.token_ids)}"
            for key, block in sorted(state.group_caches[group].items(), key=lambda item: item[1])
        )
        lines.append(
            f"state group {group} (checkpoint every {kind.interval} tokens): running "
            f"{running or 'none'}; checkpoints (block@tokens) {checkpoints or 'none'}"
        )
    return "".join(f"\n{line}" for line in lines)


def host_tier_map(
    manager: KVCacheManager, swapped_ids: Collection[str], labels: Mapping[str, str], width: int
) -> str:
    """The host tier under the pool's map: a title line naming the swapped-out requests,
    then one cell per host block (held by a swapped request ``S``, holding a cached
    prefix ``:``, free ``.``), wrapped to ``width``; empty without a host tier.

    NOTE: cells are grouped by state, not in host block id order: the manager's API
    counts host blocks (``usage()``) but does not list which request holds which.
    """
    usage = manager.usage()
    if not usage.host_blocks:
        return ""
    swapped = [label for request_id, label in labels.items() if request_id in swapped_ids]
    cells = (
        ["[S ]"] * usage.host_swapped_blocks
        + ["[: ]"] * usage.host_cached_blocks
        + ["[. ]"] * (usage.host_blocks - usage.host_swapped_blocks - usage.host_cached_blocks)
    )
    per_row = max(1, width // 4)
    rows = ["".join(cells[start : start + per_row]) for start in range(0, len(cells), per_row)]
    title = (
        f"host: {usage.host_blocks} blocks; {usage.host_swapped_blocks} held by swapped "
        f"requests ({', '.join(swapped) or 'none'}), {usage.host_cached_blocks} cached, "
        f"{usage.host_free_blocks} free"
    )
    return "\n" + "\n".join([title, *rows])
