"""``pagedkv fuzz [SECONDS] [WORKERS]``: ``scripts/fuzz.sh`` with a progress bar and Ctrl-C.

The fuzzing itself is the script's (workers, seeds, the example database, the tally); the
targets live in ``tests/``, which no wheel ships, so this runs from a source checkout only.
On Ctrl-C the workers are stopped and what they found stays where the script keeps it.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.cli.parsing import EXIT_INTERRUPTED, OneLineParser, fail
from harness.progress import Progress

SOURCE_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path("scripts/fuzz.sh")
TARGETS = Path("tests/support/fuzz_targets.py")
PLAIN_EVERY_S = 60  # a progress line a minute when piped; a bar on a terminal redraws each second


def main(argv: list[str] | None = None, prog: str = "pagedkv fuzz") -> int:
    """Run the fuzzing for ``SECONDS``; returns the script's exit status (1: a failure)."""
    parser = OneLineParser(
        prog=prog,
        description="Fuzz the lockstep state machines (impl against spec) with fresh random "
        "seeds until the time is up, one worker per core by default (scripts/fuzz.sh: logs "
        "and tallies in .hypothesis/fuzz-logs/, failing cases in .hypothesis/fuzz-db). "
        "Needs a source checkout with its .venv.",
        epilog="Exit status: 0 no failure found, 1 a failure found, 2 bad input, 130 interrupted.",
    )
    parser.add_argument("seconds", type=int, nargs="?", default=3600, help="default 3600")
    parser.add_argument("workers", type=int, nargs="?", default=None, help="default: one per core")
    args = parser.parse_args(argv)
    if args.seconds < 1 or (args.workers is not None and args.workers < 1):
        return fail(prog, f"SECONDS and WORKERS must be >= 1, got {args.seconds}, {args.workers}")
    if not (SOURCE_ROOT / SCRIPT).is_file() or not (SOURCE_ROOT / TARGETS).is_file():
        return fail(prog, f"needs a source checkout: no {SCRIPT} and {TARGETS} under {SOURCE_ROOT}")
    workers = [] if args.workers is None else [str(args.workers)]
    progress = Progress.for_stderr("[fuzz]")
    # Its own session: Ctrl-C reaches us only, and we stop the script's whole process group.
    process = subprocess.Popen(
        ["bash", str(SCRIPT), str(args.seconds), *workers], cwd=SOURCE_ROOT, start_new_session=True
    )
    started = time.monotonic()
    every = 1 if progress.is_bar else PLAIN_EVERY_S
    try:
        while True:
            try:
                process.wait(timeout=every)
                break
            except subprocess.TimeoutExpired:
                elapsed = min(int(time.monotonic() - started), args.seconds)
                progress(f"fuzzing: second {elapsed}/{args.seconds}")
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        progress.finish()
        elapsed = int(time.monotonic() - started)
        print(
            f"{prog}: interrupted after {elapsed} of {args.seconds} s; logs kept in "
            ".hypothesis/fuzz-logs/, failing cases found so far in .hypothesis/fuzz-db",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    progress.finish()
    return process.returncode
