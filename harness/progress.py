"""Progress on stderr the way people expect: a bar with counts and rate on a terminal, plain
lines when stderr is piped (or the command prints JSON), never on stdout.

A message ``"STAGE: ... N/M"`` (what ``run_equivalence`` and the other long jobs report as
they start item N of M) counts a stage; any other message is a plain line. It is *not* a
logger: one stage at a time, no nesting.
"""

import re
import sys
import time
from typing import TextIO

_COUNTED = re.compile(r"^(?P<stage>.*?):? (?:\w+ )?(?P<number>\d+)/(?P<total>\d+)$")
BAR_WIDTH = 24


class Progress:
    """A callable taking progress messages; ``bar`` draws one redrawn line per stage."""

    def __init__(self, prefix: str, stream: TextIO, bar: bool) -> None:
        self._prefix = prefix
        self._stream = stream
        self._bar = bar
        self._stage: str | None = None
        self._started = 0.0
        self._total = 0
        self._last = ""
        self._done = 0

    @classmethod
    def for_stderr(cls, prefix: str, plain: bool = False) -> "Progress":
        """Bars when stderr is a terminal and ``plain`` is not asked for, else lines."""
        return cls(prefix, sys.stderr, bar=sys.stderr.isatty() and not plain)

    @property
    def is_bar(self) -> bool:
        """Whether this draws bars (a terminal) rather than lines."""
        return self._bar

    def __call__(self, message: str) -> None:
        counted = _COUNTED.match(message)
        self._last = message
        self._done = 0 if counted is None else int(counted["number"]) - 1
        if not self._bar or counted is None:
            self.finish()
            print(f"{self._prefix} {message}", file=self._stream, flush=True)
            return
        stage, number = counted["stage"], int(counted["number"])
        if stage != self._stage:
            self.finish()
            self._stage, self._started, self._total = stage, time.monotonic(), int(counted["total"])
        self._draw(number - 1)

    def where(self) -> str:
        """Where the work was, for an interruption message: ``in STAGE after N of M
        requests`` (or the last message; ``before starting`` when there was none)."""
        counted = _COUNTED.match(self._last)
        if counted is None:
            return f"while {self._last}" if self._last else "before starting"
        return f"in {counted['stage']} after {self._done} of {counted['total']} {_unit(self._last)}"

    def finish(self) -> None:
        """End the current bar at its total (a stage's last item is done when the next stage
        or message starts)."""
        if self._stage is not None:
            self._draw(self._total)
            print(file=self._stream, flush=True)
            self._stage = None

    def _draw(self, done: int) -> None:
        elapsed = time.monotonic() - self._started
        rate = f"{done / elapsed:.2f}/s" if elapsed > 0 and done else "-/s"
        filled = BAR_WIDTH * done // max(self._total, 1)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        line = f"{self._prefix} {self._stage} |{bar}| {done}/{self._total} {rate}"
        print(f"\r\x1b[K{line}", end="", file=self._stream, flush=True)


def _unit(message: str) -> str:
    """The counted thing of a ``STAGE: UNIT N/M`` message, plural (``requests``)."""
    words = message.rsplit(" ", 2)
    return f"{words[-2]}s" if len(words) == 3 and words[-2].isalpha() else "items"
