"""``pagedkv fuzz``: long fuzzing of the lockstep state machines, on this machine
(``scripts/fuzz.sh``, with a progress bar and Ctrl-C) or as Ray tasks on a cluster sharing
a Redis example database (``harness.cli.fuzz_cluster``).

The targets live in ``tests/``, which no wheel ships, so this runs from a source checkout
only. On Ctrl-C the workers are stopped and what they found stays where it is kept.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.parsing import (
    EXIT_INTERRUPTED,
    OneLineParser,
    UsageError,
    fail,
    run_interruptible,
)
from harness.progress import Progress

SOURCE_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path("scripts/fuzz.sh")
TARGETS = Path("tests/support/fuzz_targets.py")
CONFORMANCE_TARGETS = "tests/conformance/fuzz_conformance.py"
DEFAULT_SECONDS = 3600
PLAIN_EVERY_S = 60  # a progress line a minute when piped; a bar on a terminal redraws each second
STOP_GRACE_S = 5.0  # how long stopped workers get to exit before SIGKILL


@dataclass(frozen=True)
class FuzzTarget:
    """What the workers fuzz: a test file of the checkout, and its environment."""

    label: str  # in the tally: "allocator", or "conformance/NAME"
    test_file: str
    environment: tuple[tuple[str, str], ...] = ()


def fuzz_target(name: str | None) -> FuzzTarget:
    """The allocator's lockstep machines, or the conformance kit's machine on target
    ``name`` (as ``scripts/fuzz.sh --target NAME``)."""
    if name is None:
        return FuzzTarget("allocator", str(TARGETS))
    environment = (("PAGEDKV_CONFORMANCE_TARGET", name),)
    return FuzzTarget(f"conformance/{name}", CONFORMANCE_TARGETS, environment)


def main(argv: list[str] | None = None, prog: str = "pagedkv fuzz") -> int:
    """Fuzz, replay or show the tally; returns the exit status (1: a failure found)."""
    args = _parser(prog).parse_args(argv)
    # Ctrl-C where no line of its own says what it stopped: one line and 130 all the same.
    return run_interruptible(prog, lambda: _main(prog, args))


def _main(prog: str, args: argparse.Namespace) -> int:
    try:
        seconds = _count("SECONDS", args.seconds, args.seconds_option) or DEFAULT_SECONDS
        workers = _count("WORKERS", args.workers, args.workers_option)
        _check(args)
    except UsageError as error:
        return fail(prog, str(error))
    if not (args.status or args.replay or args.ray):
        return _plain(prog, seconds, workers, args.target, args.database)
    from harness.cli import fuzz_cluster  # noqa: PLC0415  (Ray and redis-py: optional)

    target = fuzz_target(args.target)
    if args.status:
        return fuzz_cluster.status(prog, args.database)
    if args.replay:
        return fuzz_cluster.replay_saved(prog, SOURCE_ROOT, target, args.database)
    address = None if args.ray == "local" else args.ray
    workers = workers or os.cpu_count() or 1
    return fuzz_cluster.run(
        prog,
        source_root=SOURCE_ROOT,
        target=target,
        database=args.database,
        address=address,
        seconds=seconds,
        workers=workers,
    )


def _count(name: str, argument: int | None, option: int | None) -> int | None:
    """SECONDS or WORKERS, given as the argument or the option (not both), >= 1."""
    if argument is not None and option is not None:
        raise UsageError(f"give {name} once (the argument or --{name.lower()})")
    value = option if argument is None else argument
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1, got {value}")
    return value


def _check(args: argparse.Namespace) -> None:
    """Everything else that can be checked before any worker starts."""
    if not (SOURCE_ROOT / SCRIPT).is_file() or not (SOURCE_ROOT / TARGETS).is_file():
        raise UsageError(f"needs a source checkout: no {SCRIPT} and {TARGETS} under {SOURCE_ROOT}")
    if args.target is not None:
        from harness.conformance.targets import TARGETS as KNOWN  # noqa: PLC0415

        if args.target not in KNOWN:
            raise UsageError(
                f"unknown conformance target {args.target!r} (one of: {', '.join(KNOWN)})"
            )
    for option, asked in (("--ray", args.ray), ("--status", args.status)):
        if asked and args.database is None:
            raise UsageError(f"{option} needs --database redis://HOST:PORT/N")
    if sum(map(bool, (args.ray, args.replay, args.status))) > 1:
        raise UsageError("--ray, --replay and --status go one at a time")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        description="Fuzz the lockstep state machines (impl against spec) with fresh random "
        "seeds until the time is up. On this machine by default (scripts/fuzz.sh: one worker "
        "per core, logs and tallies in .hypothesis/fuzz-logs/, failing cases in "
        ".hypothesis/fuzz-db); with --ray, as Ray tasks on a cluster, sharing failing cases "
        "and a live tally through Redis (--database). Needs a source checkout with its .venv "
        "(--ray, --database, --status: the 'cluster' extra).",
        epilog="Exit status: 0 no failure found, 1 a failure found (or replayed, or a worker "
        "died), 2 bad input, 130 interrupted. Redis lost mid-run is one line, not a failure: "
        "the run goes on with the local database.",
    )
    parser.add_argument(
        "seconds", type=int, nargs="?", metavar="SECONDS", help=f"default {DEFAULT_SECONDS}"
    )
    parser.add_argument(
        "workers", type=int, nargs="?", metavar="WORKERS", help="default: one per core"
    )
    parser.add_argument("--seconds", type=int, dest="seconds_option", metavar="SECONDS")
    parser.add_argument("--workers", type=int, dest="workers_option", metavar="WORKERS")
    parser.add_argument(
        "--target",
        metavar="NAME",
        help="fuzz the conformance kit's machine on this target instead "
        "(python -m harness.conformance --help lists them)",
    )
    parser.add_argument(
        "--database",
        metavar="URL",
        help="redis://HOST:PORT/N: failing cases saved to and replayed from this Redis as "
        "well as the local database; --ray keeps its tally there too. Lost mid-run, it is "
        "one line and the run goes on with the local database",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run the workers as Ray tasks: on a cluster of WORKERS CPUs started on this "
        "machine (local, the default; $RAY_ADDRESS's cluster when it is set), the cluster "
        "this machine is in (auto), or a remote one (ray://HOST:PORT, HOST:PORT); put it "
        "after SECONDS and WORKERS",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="run the saved failing cases only (no search): exit 1 with their steps",
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="print the tally of the runs recorded in --database, and exit",
    )
    return parser


def _plain(
    prog: str, seconds: int, workers: int | None, target: str | None, database: str | None
) -> int:
    """scripts/fuzz.sh with a progress bar; Ctrl-C stops its whole process group."""
    if database is not None:  # checked here too, for a line under our name
        from harness.cluster.shared_database import SharedDatabaseError, connect  # noqa: PLC0415

        try:
            connect(database)
        except SharedDatabaseError as error:
            return fail(prog, str(error))
    options = [
        *(["--target", target] if target else []),
        *(["--database", database] if database else []),
    ]
    counts = [str(seconds), *([] if workers is None else [str(workers)])]
    progress = Progress.for_stderr("[fuzz]")
    every = 1 if progress.is_bar else PLAIN_EVERY_S
    started = time.monotonic()
    # Its own session: Ctrl-C reaches us only, and we stop the script's whole process group.
    process = subprocess.Popen(
        ["bash", str(SCRIPT), *options, *counts], cwd=SOURCE_ROOT, start_new_session=True
    )
    try:
        while True:
            try:
                process.wait(timeout=every)
                break
            except subprocess.TimeoutExpired:
                elapsed = min(int(time.monotonic() - started), seconds)
                progress(f"fuzzing: second {elapsed}/{seconds}")
    except KeyboardInterrupt:
        _stop_group(process)
        progress.finish()
        elapsed = int(time.monotonic() - started)
        print(
            f"{prog}: interrupted after {elapsed} of {seconds} s; logs kept in "
            ".hypothesis/fuzz-logs/, failing cases found so far in .hypothesis/fuzz-db",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    progress.finish()
    return process.returncode


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """Stop the script's whole process group and return once no worker is left: SIGTERM,
    then SIGKILL to whatever still runs after ``STOP_GRACE_S``. Waiting for the script alone
    returned while a loaded machine had a pytest worker still exiting (seen in CI)."""
    os.killpg(process.pid, signal.SIGTERM)
    process.wait()
    deadline = time.monotonic() + STOP_GRACE_S
    while _group_has_workers(process.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def _group_has_workers(group: int) -> bool:
    """Whether a process of ``group`` that has not exited yet is left (from /proc: a zombie
    waiting for its parent's reaping has exited)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False
