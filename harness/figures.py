"""Drawing the harness's figures: their fixed size, and the pool over a main-command run.

Matplotlib draws with the Agg backend: no display is needed. Every figure has a fixed size
in pixels (``FIGURE_HEIGHT`` high, ``PANEL_WIDTH`` per panel). The benchmark figures are
``harness.bench.plots``'; this module is what ``python -m harness --plot FILE`` needs, so
the CLI imports no benchmark.
"""

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: draw to files, never to a display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from harness.runtime.results import UsageSample

DPI = 100
PANEL_WIDTH = 7.0  # inches: 700 pixels per panel
FIGURE_HEIGHT = 4.5  # inches: 450 pixels


def new_figure(panels: int) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` side by side, each ``PANEL_WIDTH`` x ``FIGURE_HEIGHT``."""
    figure, axes = plt.subplots(
        1, panels, figsize=(PANEL_WIDTH * panels, FIGURE_HEIGHT), dpi=DPI, squeeze=False
    )
    return figure, list(axes[0])


def save_figure(figure: Figure, path: Path) -> None:
    """Write ``figure`` to ``path`` at ``DPI`` and close it."""
    # NOTE: no bbox_inches="tight": it would change the pixel size the tests expect.
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)


def preemption_steps(usage: Sequence[UsageSample]) -> list[int]:
    """The indices of the samples whose step preempted (the manager's counter grew)."""
    before = [0, *(sample.preemptions for sample in usage)]
    return [i for i, sample in enumerate(usage) if sample.preemptions > before[i]]


def plot_pool_over_time(usage: Sequence[UsageSample], total_blocks: int, path: Path) -> None:
    """The pool after each step: blocks used, cached free, free (stacked), preemptions marked."""
    figure, (axes,) = new_figure(1)
    steps = range(len(usage))
    used = [sample.used_blocks for sample in usage]
    cached = [sample.cached_free_blocks for sample in usage]
    free = [total_blocks - u - c for u, c in zip(used, cached, strict=True)]
    axes.stackplot(
        steps,
        used,
        cached,
        free,
        labels=["used", "cached free", "free"],
        colors=["tab:blue", "tab:cyan", "whitesmoke"],
        step="post",
    )
    for index, step in enumerate(preemption_steps(usage)):
        axes.axvline(step, color="red", linewidth=1, label="preemption" if index == 0 else None)
    axes.set_xlim(0, max(1, len(usage) - 1))
    axes.set_ylim(0, total_blocks)
    axes.set_xlabel("engine step (one sample per forward step)")
    axes.set_ylabel("blocks")
    axes.set_title(f"the pool over the run: {total_blocks} blocks")
    axes.legend(loc="upper right", fontsize=8)
    save_figure(figure, path)
