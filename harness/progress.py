"""Progress on stderr the way people expect: a bar with counts and rate on a terminal, plain
lines when stderr is piped (or the command prints JSON), never on stdout.

A message ``"STAGE: ... N/M"`` (what ``run_equivalence`` and the other long jobs report as
they start item N of M) counts a stage; any other message is a plain line. It is *not* a
logger: one stage at a time, no nesting.
"""

import contextlib
import io
import re
import sys
import time
from collections.abc import Iterator
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
        self._first_done = 0
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
        if not self._bar or counted is None or counted["stage"] != self._stage:
            self.finish()
        self._last = message
        self._done = 0 if counted is None else int(counted["number"]) - 1
        if not self._bar or counted is None:
            print(self._labelled(message), file=self._stream, flush=True)
            return
        if counted["stage"] != self._stage:
            self._stage, self._total = counted["stage"], int(counted["total"])
            self._started, self._first_done = time.monotonic(), self._done
        self._draw(self._done)

    def where(self) -> str:
        """Where the work was, for an interruption message: ``in STAGE after N of M
        requests`` (or the last message; ``before starting`` when there was none)."""
        counted = _COUNTED.match(self._last)
        if counted is None:
            return f"while {self._last}" if self._last else "before starting"
        return f"in {counted['stage']} after {self._done} of {counted['total']} {_unit(self._last)}"

    def verbatim(self, line: str) -> None:
        """Print ``line`` as it is (ending the current bar first)."""
        self.finish()
        print(line, file=self._stream, flush=True)

    def finish(self) -> None:
        """End the current bar, its last started item done (it is, once the next stage or
        message starts)."""
        if self._stage is not None:
            self._draw(self._done + 1)
            print(file=self._stream, flush=True)
            self._stage = None

    def _labelled(self, text: str) -> str:
        return f"{self._prefix} {text}" if self._prefix else text

    def _draw(self, done: int) -> None:
        elapsed, counted = time.monotonic() - self._started, done - self._first_done
        rate = f"{counted / elapsed:.2f}/s" if elapsed > 0 and counted else "-/s"
        filled = BAR_WIDTH * done // max(self._total, 1)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        line = self._labelled(f"{self._stage} |{bar}| {done}/{self._total} {rate}")
        print(f"\r\x1b[K{line}", end="", file=self._stream, flush=True)


@contextlib.contextmanager
def stderr_as_progress() -> Iterator[None]:
    """Inside, on a terminal, each ``STAGE ... N/M`` line written to ``sys.stderr`` redraws a
    bar instead, and every other line passes through as it is: the hook for the benchmarks,
    whose stages print such lines. Elsewhere (piped) stderr is left alone."""
    real = sys.stderr
    if not real.isatty():
        yield
        return
    progress = Progress("", real, bar=True)
    sys.stderr = _Lines(progress)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = real
        progress.finish()


class _Lines(io.TextIOBase):
    """A text stream handing each complete line to ``progress``: counted lines as progress,
    the others verbatim."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self._progress = progress
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._line(self._pending)
        self._pending = ""

    def _line(self, line: str) -> None:
        if _COUNTED.match(line.strip()):
            self._progress(line.strip())
        else:
            self._progress.verbatim(line)


def _unit(message: str) -> str:
    """The counted thing of a ``STAGE: UNIT N/M`` message, plural (``requests``)."""
    words = message.rsplit(" ", 2)
    return f"{words[-2]}s" if len(words) == 3 and words[-2].isalpha() else "items"
