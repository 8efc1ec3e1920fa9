"""``python -m harness.bench.fuzz_cluster``: fuzzing steps per second per core through Ray
and Redis (``pagedkv fuzz --ray``'s workers) against ``scripts/fuzz.sh``, on this machine.

Both fuzz the allocator's lockstep machines (``tests/support/fuzz_targets.py``) with the
same number of workers for the same seconds: fuzz.sh its bash workers, the other as Ray
tasks on a local cluster of as many CPUs, sharing a throwaway loopback ``redis-server``
(example database and tally). The Ray cluster and Redis start once, before the warm-up,
as they would stay up on a real cluster. After one warm-up run of each, the two take
turns (the order alternating) for ``--rounds`` rounds; steps/s per core is the steps
counted over the run's wall time times its workers, median over rounds. Seeds are
Hypothesis' own, fresh in each pytest process, as in a real run: a forced seed would turn
the example database off, and with it part of what is measured. The load average before
each run is printed, since the machine may be shared. Needs a source checkout, the
'cluster' extra and ``redis-server``.
"""

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness.parsing import OneLineParser, fail, run_interruptible

PROG = "python -m harness.bench.fuzz_cluster"
SOURCE_ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests/support/fuzz_targets.py"
_SUMMARY = re.compile(
    r"fuzz: \d+ worker\(s\), (\d+) s, \d+ process\(es\), (\d+) test cases, (\d+) steps"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print one table; returns the exit status."""
    parser = OneLineParser(
        prog=PROG,
        description="Fuzzing steps/s per core: Ray tasks sharing a loopback Redis against "
        "scripts/fuzz.sh, the same workers and seconds, taking turns; medians over --rounds.",
    )
    parser.add_argument("--seconds", type=int, default=120, help="each timed run (default 120)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="workers = cores used (default 2)")
    parser.add_argument("--warmup-seconds", type=int, default=30, help="the warm-up runs")
    args = parser.parse_args(argv)
    if min(args.seconds, args.rounds, args.workers, args.warmup_seconds) < 1:
        return fail(PROG, "--seconds, --rounds, --workers and --warmup-seconds must be >= 1")
    if not (SOURCE_ROOT / TARGET).is_file():
        return fail(PROG, f"needs a source checkout: no {TARGET} under {SOURCE_ROOT}")
    return run_interruptible(
        PROG, lambda: _compare(args.seconds, args.rounds, args.workers, args.warmup_seconds)
    )


def _compare(seconds: int, rounds: int, workers: int, warmup: int) -> int:
    from harness.cluster import ray_run  # noqa: PLC0415  (the 'cluster' extra)
    from harness.cluster.redis_server import loopback_redis  # noqa: PLC0415

    with loopback_redis() as server:
        database = server.url
        ray_run.start_local_cluster(workers)
        try:
            runs = {"fuzz.sh": _script, "Ray + Redis": _on_ray}
            for name, run in runs.items():
                print(f"warm-up: {name}, {warmup} s", file=sys.stderr, flush=True)
                run(warmup, workers, database)
            rates: dict[str, list[float]] = {name: [] for name in runs}
            for round_ in range(rounds):
                order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
                for name in order:
                    load = os.getloadavg()[0]
                    steps, wall = runs[name](seconds, workers, database)
                    rates[name].append(steps / wall / workers)
                    print(
                        f"round {round_ + 1}/{rounds}: {name}: {steps:,} steps in {wall:.1f} s, "
                        f"{rates[name][-1]:,.0f} steps/s/core (load {load:.2f} before)",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            ray_run.disconnect()
    _table(rates, seconds, rounds, workers)
    return 0


def _script(seconds: int, workers: int, database: str) -> tuple[int, float]:
    """``scripts/fuzz.sh SECONDS WORKERS`` (its own local database); steps and wall time."""
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "scripts/fuzz.sh", str(seconds), str(workers)],
        cwd=SOURCE_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.monotonic() - started
    summary = _SUMMARY.search(done.stdout)
    if summary is None:
        raise RuntimeError(f"fuzz.sh printed no summary: {done.stdout}{done.stderr}")
    return int(summary[3]), wall


def _on_ray(seconds: int, workers: int, database: str) -> tuple[int, float]:
    """``workers`` Ray tasks for ``seconds``, as ``pagedkv fuzz --ray`` runs them."""
    from harness.cluster import ray_run  # noqa: PLC0415
    from harness.cluster.shared_database import connect  # noqa: PLC0415
    from harness.cluster.tally import RunTally  # noqa: PLC0415
    from harness.cluster.worker import FuzzJob  # noqa: PLC0415

    tally = RunTally.start(connect(database), "allocator", workers, seconds)
    started = time.monotonic()
    job = FuzzJob(
        source_root=str(SOURCE_ROOT),
        test_file=TARGET,
        target="allocator",
        database=database,
        run_id=tally.run_id,
        deadline=time.time() + seconds,
        logs=f".hypothesis/fuzz-logs/{tally.run_id}",
    )
    ray_run.run_workers(job, workers, tally, follow=lambda ended: None)
    wall = time.monotonic() - started
    tally.finish("finished")
    return tally.totals().steps, wall


def _table(rates: dict[str, list[float]], seconds: int, rounds: int, workers: int) -> None:
    plain = statistics.median(rates["fuzz.sh"])
    print(f"\n{workers} workers, {seconds} s a run, median of {rounds} rounds (steps/s per core)\n")
    print("| method | steps/s per core (median) | rounds | vs fuzz.sh |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        each = ", ".join(f"{value:,.0f}" for value in values)
        print(f"| {name} | {median:,.0f} | {each} | {median / plain:.1%} |")


if __name__ == "__main__":
    sys.exit(main())
