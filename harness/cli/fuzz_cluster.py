"""``pagedkv fuzz --ray | --replay | --status``: the fuzzing commands that share a Redis
database (``harness.cluster``), with their lines and exit codes.

Everything that can be refused is refused before any worker starts, in one line with exit
2: an unreachable Redis or Ray, a Redis holding another Hypothesis version's examples.
"""

import sys
import time
from pathlib import Path

from harness.cli.fuzz import FuzzTarget
from harness.cli.parsing import EXIT_INTERRUPTED, fail
from harness.cluster import ray_run
from harness.cluster.replay import replay
from harness.cluster.shared_database import LOCAL_DATABASE, SharedDatabaseError, connect
from harness.cluster.tally import RunTally, RunTotals, recent_runs
from harness.cluster.worker import FuzzJob, WorkerReport

EXIT_FAILURE = 1
PLAIN_EVERY_S = 60  # the tally line a minute when piped; on a terminal it redraws each second
STATUS_RUNS = 10  # --status looks at the runs started last


def run(
    prog: str,
    *,
    source_root: Path,
    target: FuzzTarget,
    database: str,
    address: str | None,
    seconds: int,
    workers: int,
) -> int:
    """Fuzz ``target`` with ``workers`` Ray tasks for ``seconds``, sharing ``database``."""
    try:
        redis = connect(database)
        started = ray_run.connect(address, workers)
    except (SharedDatabaseError, ray_run.ClusterError) as error:
        return fail(prog, str(error))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted while connecting to Ray", file=sys.stderr)
        return EXIT_INTERRUPTED
    tally = RunTally.start(redis, target.label, workers, seconds)
    job = FuzzJob(
        source_root=str(source_root),
        test_file=target.test_file,
        target=target.label,
        database=database,
        run_id=tally.run_id,
        deadline=time.time() + seconds,
        logs=f".hypothesis/fuzz-logs/{tally.run_id}",
        environment=target.environment,
    )
    cpus = ray_run.available_cpus()
    print(
        f"{prog}: run {tally.run_id}: {workers} worker(s) on Ray ({cpus} CPUs) for {seconds} s, "
        f"target {target.label}; logs in {job.logs}/ on each machine",
        file=sys.stderr,
    )
    if cpus < workers:
        print(f"{prog}: only {cpus} CPUs: the other workers wait for one", file=sys.stderr)
    follow = _Follow(tally)
    try:
        reports = ray_run.run_workers(job, workers, tally, follow)
    except KeyboardInterrupt:
        follow.end()
        tally.finish("interrupted")
        ray_run.disconnect(started)
        totals = tally.totals()
        print(
            f"{prog}: interrupted; every worker stopped. {totals.describe()} "
            f"(failing cases found so far in {database})",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    follow.end()
    tally.finish("finished")
    ray_run.disconnect(started)
    return _summary(prog, tally, reports)


def status(prog: str, database: str) -> int:
    """Print the tally of the runs recorded in ``database``: those with workers alive, or
    else the last one."""
    try:
        redis = connect(database)
    except SharedDatabaseError as error:
        return fail(prog, str(error))
    totals = [run.totals() for run in recent_runs(redis, STATUS_RUNS)]
    if not totals:
        print(f"{prog}: no run recorded in {database}")
        return 0
    for line in [t.describe() for t in totals if t.alive] or [totals[0].describe()]:
        print(line)
    return 0


def replay_saved(prog: str, source_root: Path, target: FuzzTarget, database: str | None) -> int:
    """Run the failing cases saved for ``target`` (local database, and ``database``)."""
    if database is not None:
        try:
            connect(database)
        except SharedDatabaseError as error:
            return fail(prog, str(error))
    where = LOCAL_DATABASE + (f" and {database}" if database else "")
    found = replay(
        source_root, target.test_file, dict(target.environment), database, LOCAL_DATABASE
    )
    if found.status == 0:
        print(f"{prog}: no saved failing case of {target.label} fails ({where})")
        return 0
    if found.status != EXIT_FAILURE:
        tail = "\n".join(found.output.strip().splitlines()[-20:])
        print(f"{tail}\n{prog}: pytest stopped with status {found.status}", file=sys.stderr)
        return found.status
    for test in found.failed:
        print(f"FAILED {test}")
    print("\n\n".join(found.steps))
    print(f"{prog}: {len(found.failed)} test(s) of {target.label} fail on cases saved in {where}")
    return EXIT_FAILURE


def _summary(prog: str, tally: RunTally, reports: list[WorkerReport]) -> int:
    """The end-of-run lines: the tally (the numbers --status shows), each failure with its
    steps, each dead worker with its reason; 1 if either happened."""
    for failure in tally.failures():
        print(f"worker {failure.worker} (run {failure.run}): FAILURE in {failure.test}")
        print(failure.steps)
    for report in reports:
        if report.died:
            print(f"worker {report.worker} died: {report.died}", file=sys.stderr)
    totals = tally.totals()
    print(f"{prog}: {totals.describe()}", file=sys.stderr)
    return EXIT_FAILURE if totals.failures or totals.died else 0


class _Follow:
    """The run's tally while it goes: one line redrawn on a terminal, a line a minute when
    piped."""

    def __init__(self, tally: RunTally) -> None:
        self._tally = tally
        self._bar = sys.stderr.isatty()
        self._last = time.monotonic()

    def __call__(self) -> None:
        if self._bar:
            print(
                f"\r\x1b[K[fuzz] {self._totals().describe()}", end="", file=sys.stderr, flush=True
            )
        elif time.monotonic() - self._last >= PLAIN_EVERY_S:
            self._last = time.monotonic()
            print(f"[fuzz] {self._totals().describe()}", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self._bar:
            print(file=sys.stderr, flush=True)

    def _totals(self) -> RunTotals:
        return self._tally.totals()
