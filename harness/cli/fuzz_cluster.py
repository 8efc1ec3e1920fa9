"""``pagedkv fuzz --ray | --replay | --status``: the fuzzing commands that share a Redis
database (``harness.cluster``), with their lines and exit codes.

Everything that can be refused is refused before any worker starts, in one line with exit
2: an unreachable Redis or Ray, a Redis holding another Hypothesis version's examples.
Redis lost once the run has started ends nothing: one line says so, and the run goes on
with each machine's local example database, the driver tallying what the workers report.
"""

import contextlib
import os
import sys
import time
from pathlib import Path

from harness.cli.fuzz import FuzzTarget
from harness.cluster import ray_run
from harness.cluster.replay import replay
from harness.cluster.shared_database import (
    SharedDatabaseError,
    connect,
    local_database,
    lost_line,
)
from harness.cluster.tally import Failure, RunTally, RunTotals, TallyLostError, recent_runs
from harness.cluster.worker import FuzzJob, WorkerReport
from harness.parsing import EXIT_INTERRUPTED, fail

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
        ray_run.connect(address, workers)
        tally = RunTally.start(redis, target.label, workers, seconds)
        job = FuzzJob(
            source_root=str(source_root),
            test_file=target.test_file,
            target=target.label,
            database=database,
            run_id=tally.run_id,
            deadline=time.time() + seconds,
            logs=f".hypothesis/fuzz-logs/{tally.run_id}",
            local_database=local_database(os.environ),
            environment=target.environment,
        )
        return _run(prog, job, workers, tally)
    except (SharedDatabaseError, ray_run.ClusterError) as error:
        return fail(prog, str(error))
    except TallyLostError as error:  # lost between the check and the run's first write
        return fail(prog, f"cannot reach Redis at {database}: {error}")
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before any worker started", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        ray_run.disconnect()


def _run(prog: str, job: FuzzJob, workers: int, tally: RunTally) -> int:
    cpus = ray_run.available_cpus()
    print(
        f"{prog}: run {tally.run_id}: {workers} worker(s) on Ray ({cpus} CPUs) for "
        f"{int(job.deadline - time.time() + 0.5)} s, target {job.target}; logs in {job.logs}/ "
        "on each machine",
        file=sys.stderr,
    )
    if cpus < workers:
        print(f"{prog}: only {cpus} CPUs: the other workers wait for one", file=sys.stderr)
    follow = _Follow(prog, tally, job, workers)
    try:
        ray_run.run_workers(job, workers, tally, follow)
    except KeyboardInterrupt:
        follow.end("interrupted")
        print(
            f"{prog}: interrupted; every worker stopped. {follow.totals().describe()} (failing "
            f"cases found so far: {job.database} and {job.local_database} on each machine)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    follow.end("finished")
    return _summary(prog, follow)


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
    local = local_database(os.environ)
    where = local + (f" and {database}" if database else "")
    found = replay(source_root, target.test_file, dict(target.environment), database, local)
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


def _summary(prog: str, follow: "_Follow") -> int:
    """The end-of-run lines: each failure with its steps, then the tally (the numbers
    ``--status`` shows); 1 if a worker found a failure or died."""
    for failure in follow.failures():
        print(f"worker {failure.worker} (run {failure.run}): FAILURE in {failure.test}")
        print(failure.steps)
    totals = follow.totals()
    print(f"{prog}: {totals.describe()}", file=sys.stderr)
    return EXIT_FAILURE if totals.failures or totals.died else 0


class _Follow:
    """The run as it goes, on stderr: a line for each worker that ends early (a failure, a
    death), a line if Redis is lost, and the tally, redrawn each second on a terminal or a
    line a minute when piped. The tally is Redis' while it answers, and once it is lost,
    what the workers reported at their end (those still running: alive, nothing counted)."""

    def __init__(self, prog: str, tally: RunTally, job: FuzzJob, workers: int) -> None:
        self._prog = prog
        self._tally = tally
        self._job = job
        self._workers = workers
        self._bar = sys.stderr.isatty()
        self._started = time.time()
        self._last = time.monotonic()
        self._state = "running"
        self._said_lost = False
        self._reports: list[WorkerReport] = []

    def __call__(self, ended: list[WorkerReport]) -> None:
        self._reports += ended
        self._tally.answers()
        self._say_if_lost()
        for report in ended:
            if report.failure or report.died:
                why = (
                    f"found a failure in {report.failure.test}"
                    if report.failure
                    else f"died: {report.died}"
                )
                self._line(f"{self._prog}: worker {report.worker} {why}")
        if self._bar:
            line = f"[fuzz] {self.totals().describe()}"
            print(f"\r\x1b[K{line}", end="", file=sys.stderr, flush=True)
        elif time.monotonic() - self._last >= PLAIN_EVERY_S:
            self._last = time.monotonic()
            self._line(f"[fuzz] {self.totals().describe()}")

    def end(self, state: str) -> None:
        """The run is over (``finished`` or ``interrupted``): record it, close the line."""
        self._state = state
        self._tally.finish(state)
        if self._bar:
            print(file=sys.stderr, flush=True)
        self._say_if_lost()

    def totals(self) -> RunTotals:
        """The run's numbers now: Redis' while it answers, else the workers' reports."""
        if self._tally.lost is None:
            with contextlib.suppress(TallyLostError):
                return self._tally.totals()
        reports = self._reports
        return RunTotals(
            run_id=self._tally.run_id,
            target=self._job.target,
            workers=self._workers,
            seconds=int(self._job.deadline - self._started + 0.5),
            started=self._started,
            state=self._state,
            cases=sum(report.cases for report in reports),
            steps=sum(report.steps for report in reports),
            failures=sum(report.failure is not None for report in reports),
            died=sum(report.died is not None for report in reports),
            alive=self._workers - len(reports) if self._state == "running" else 0,
        )

    def failures(self) -> list[Failure]:
        """The failures found so far: Redis' while it answers, else the workers' reports."""
        if self._tally.lost is None:
            with contextlib.suppress(TallyLostError):
                return self._tally.failures()
        return [report.failure for report in self._reports if report.failure]

    def _say_if_lost(self) -> None:
        if self._tally.lost is None or self._said_lost:
            return
        self._said_lost = True
        seconds = int(time.time() - self._started)
        local = f"{self._job.local_database} on each machine"
        self._line(
            f"{self._prog}: {lost_line(self._job.database, seconds, self._tally.lost, local)}"
        )

    def _line(self, text: str) -> None:
        if self._bar:
            print("\r\x1b[K", end="", file=sys.stderr)
        print(text, file=sys.stderr, flush=True)
