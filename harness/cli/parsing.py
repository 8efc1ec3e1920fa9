"""Command-line plumbing shared by pagedkv's scripts: bad input is one line, never a traceback."""

import argparse
import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2


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
