"""Command-line plumbing shared by pagedkv's scripts: bad input is one line, never a traceback."""

import argparse
import sys
from collections.abc import Callable
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


def run_interruptible(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status, or one line and 130 when Ctrl-C stops it (no traceback)."""
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
