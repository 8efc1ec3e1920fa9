"""Replaying the saved failures of a fuzz target, without searching for new ones.

pytest runs the target once under the ``fuzz-replay`` profile (``tests/conftest.py``): only
the examples saved in the local database and, when one is named, the shared Redis database
(read-only) run; nothing is generated and nothing shrunk, so a replay takes seconds and
says exactly whether a saved failure still fails, with its steps.

``python -m harness.cluster.replay TEST_FILE [--database URL] [--timeout SECONDS]``: the
same from the current directory, for ``scripts/fuzz.sh``'s replay at the end of a run.
"""

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.cluster.failures import failed_tests, shrunk_steps
from harness.cluster.shared_database import LOCAL_ENV, SHARED_ENV, local_database
from harness.parsing import OneLineParser, int_in, run_interruptible

PROG = "python -m harness.cluster.replay"

PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")  # a worker's run adds "-x"


@dataclass(frozen=True)
class Replay:
    """What a replay found: pytest's exit status, the tests that failed, the steps of each
    failing case, and pytest's whole output."""

    status: int
    failed: list[str]
    steps: list[str]
    output: str


def replay(
    source_root: Path,
    test_file: str,
    environment: Mapping[str, str],
    database: str | None,
    local_database: str,
    *,
    timeout_s: float | None = None,
) -> Replay:
    """Replay the failures saved for ``test_file`` (run from ``source_root``); a replay
    still running after ``timeout_s`` is killed, and answers status 124 with no failure."""
    variables = {
        **os.environ,
        **environment,
        "HYPOTHESIS_PROFILE": "fuzz-replay",
        LOCAL_ENV: local_database,
    }
    variables.pop(SHARED_ENV, None)
    if database:
        variables[SHARED_ENV] = database
    try:
        done = subprocess.run(
            [sys.executable, *PYTEST, test_file],
            cwd=source_root,
            env=variables,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Replay(124, [], [], f"the replay did not end within {timeout_s} s")
    output = done.stdout + done.stderr
    return Replay(done.returncode, failed_tests(output), shrunk_steps(output), output)


def main(argv: list[str] | None = None) -> int:
    """Replay TEST_FILE's saved failures (the local database, and ``--database``'s); print
    pytest's output, and exit with its status: 0 none fails, 1 a saved case fails, 124
    still running after ``--timeout`` seconds (killed)."""
    parser = OneLineParser(prog=PROG, description=main.__doc__)
    parser.add_argument("test_file", metavar="TEST_FILE")
    parser.add_argument("--database", metavar="URL", help="redis://HOST:PORT/N, read only")
    parser.add_argument("--timeout", type=int_in(1), metavar="SECONDS")
    args = parser.parse_args(argv)

    def run() -> int:
        found = replay(
            Path.cwd(),
            args.test_file,
            {},
            args.database,
            local_database(os.environ),
            timeout_s=args.timeout,
        )
        print(found.output, end="")
        return found.status

    return run_interruptible(PROG, run)


if __name__ == "__main__":
    sys.exit(main())
