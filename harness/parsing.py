"""Command-line plumbing shared by pagedkv's scripts (the CLI, the benchmarks, the kit, the
tiny-model script): bad input is one line, never a traceback, and Ctrl-C is one line and
exit 130, from the first instant."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C


class UsageError(Exception):
    """Bad input found after parsing (an unreadable file, a pool too small): exit 2, one line."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are a single ``prog: error: ...`` line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> int:
    """Print one error line for ``prog`` and return the bad-input exit code."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def int_in(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [``least``, ``most``] (no upper bound when
    ``most`` is None); anything else is the parser's one-line error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if most is None and value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        if most is not None and not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be in [{least}, {most:,}], got {value:,}")
        return value

    return parse


def thread_count(text: str) -> int:
    """An argparse ``type`` for ``--threads``: between 1 and the CPUs this process may run
    on (torch 2.13 segfaults on ``set_num_threads(10**9)``; libgomp aborts out of memory)."""
    cpus = len(os.sched_getaffinity(0))
    value = int_in(-sys.maxsize)(text)
    if not 1 <= value <= cpus:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {cpus} (the CPUs here), got {value}"
        )
    return value


def run_interruptible(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status, or one line and 130 when Ctrl-C stops it (no traceback)."""
    interrupts_raise()
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def exit_on_interrupt(prog: str) -> None:
    """From now until ``interrupts_raise()``, Ctrl-C writes ``<prog>: interrupted while
    starting`` and exits 130 at once: for the seconds a command spends importing torch and
    transformers, before its own one-line handling is in place.

    NOTE: exiting in the handler, not raising ``KeyboardInterrupt``: one raised mid-import
    prints a 15-82-line traceback, and one raised inside a ``__del__`` is swallowed (the
    command then ran on to exit 0 in 2 of 10 tries). Nothing is written yet, so there is
    nothing to clean up. A process that ignores SIGINT (started with it ignored) keeps
    ignoring it.
    """
    message = f"{prog}: interrupted while starting\n".encode()

    def stop(_signal: int, _frame: FrameType | None) -> None:
        os.write(2, message)  # fd 2: stderr, unbuffered
        os._exit(EXIT_INTERRUPTED)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, stop)
        _STARTING.append(stop)


def interrupts_raise() -> None:
    """Undo ``exit_on_interrupt``: Ctrl-C raises ``KeyboardInterrupt`` again, for the
    command's own one-line handling (which says what was interrupted)."""
    if _STARTING and signal.getsignal(signal.SIGINT) in _STARTING:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _STARTING.clear()


# The handlers exit_on_interrupt installed, so interrupts_raise replaces only those.
_STARTING: list[Callable[[int, FrameType | None], None]] = []
