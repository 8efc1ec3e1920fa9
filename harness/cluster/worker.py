"""One fuzz worker: ``scripts/fuzz.sh``'s worker loop as a function, for a Ray task to run.

Until the deadline it runs pytest on a fuzz target of a source checkout, under the ``fuzz``
profile, again and again, the example database shared through Redis
(``harness.cluster.shared_database``). Each second it adds what its pytest process has
tallied (``tests/support/fuzz_targets.py`` writes ``<pid>.txt`` every 10 test cases) to
the run's tally in Redis and renews its heartbeat there (Redis lost, it goes on without,
counting for its report alone). A failure stops it, recorded with its shrunk steps; a
pytest process that ends any other way before the deadline (killed, an internal error)
counts it as dead, with the reason. At the deadline, as in fuzz.sh,
pytest gets SIGINT (it stops cleanly and writes its tally) and SIGKILL a minute later;
then the worker replays its local database, where a failure still being shrunk at the
interrupt is saved although pytest reports none.
Should the worker itself be killed, Ray kills its process group, pytest with it (within a
second, Ray 2.60; ``tests/cluster/test_fuzz_cluster_cli.py`` checks it).

No seed is forced: Hypothesis draws a fresh 128-bit one in each process, and a forced seed
(``--hypothesis-seed``) would turn the example database off, failures neither saved nor
replayed.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness.cluster.failures import failed_tests, shrunk_steps
from harness.cluster.replay import PYTEST, replay
from harness.cluster.shared_database import (
    LOCAL_DATABASE,
    LOCAL_ENV,
    SHARED_ENV,
    UnreachableDatabaseError,
    connect,
    redis_client,
)
from harness.cluster.tally import Failure, RunTally

POLL_S = 1.0
GRACE_S = 60  # SIGINT at the deadline, SIGKILL this much later (fuzz.sh's `timeout -k 60`)
# NOTE: and SIGINT again every few seconds until then: on a loaded machine a pytest process
# lost the first interrupt in a garbage-collector callback and fuzzed on (the fuzz target
# now raises a lost interrupt again itself; a target of another kind may not).
INTERRUPT_EVERY_S = 5
STOP_S = 10  # on Ctrl-C, how long pytest gets to stop before SIGKILL


@dataclass(frozen=True)
class FuzzJob:
    """What every worker of a run does: fuzz ``test_file`` of the checkout at
    ``source_root`` until ``deadline`` (``time.time()``), sharing the database at
    ``database``; paths relative to ``source_root`` unless absolute."""

    source_root: str
    test_file: str
    target: str
    database: str
    run_id: str
    deadline: float
    logs: str
    local_database: str = LOCAL_DATABASE
    environment: tuple[tuple[str, str], ...] = ()  # more variables for pytest


@dataclass(frozen=True)
class WorkerReport:
    """What one worker ran, and why it stopped early if it did."""

    worker: str
    processes: int
    cases: int
    steps: int
    failure: Failure | None = None
    died: str | None = None


def fuzz_worker(job: FuzzJob, index: int) -> WorkerReport:
    """Run worker ``w<index>`` of ``job`` until the deadline, a failure or its death."""
    worker = _Worker(job, f"w{index}")
    if not (Path(job.source_root) / job.test_file).is_file():
        return worker.died(f"no {job.test_file} on {socket.gethostname()}")
    worker.logs.mkdir(parents=True, exist_ok=True)
    try:
        for run in range(1, sys.maxsize):
            left = job.deadline - time.time()
            if left <= 0:
                break
            status, interrupted, output = worker.run_pytest(run, left)
            # A failure is a test pytest reports failed. Once interrupted at the deadline,
            # pytest's exit status says nothing more (it can even crash reporting the
            # interrupt, with status 1).
            if failed := failed_tests(output):
                return worker.failed(Failure(failed[0], worker.name, run, _steps(output)))
            if interrupted:
                return worker.replayed(run)
            if status != 0:
                return worker.died(f"pytest exited with {status}: {_tail(output)}")
        return worker.report()
    finally:
        worker.tally.gone(worker.name)


class _Worker:
    """One worker's state: its tally in Redis, where it logs, and what it has counted."""

    def __init__(self, job: FuzzJob, name: str) -> None:
        self.job = job
        self.name = name
        try:
            redis = connect(job.database)
        except UnreachableDatabaseError:  # lost before this worker started: it goes on without
            redis = redis_client(job.database)
        self.tally = RunTally(redis, job.run_id)
        self.logs = Path(job.source_root) / job.logs
        self._tally_dir = self.logs / f"tally-{name}"
        self._processes = 0
        self._cases = 0
        self._steps = 0
        self.tally.beat(name)

    def report(self, failure: Failure | None = None, died: str | None = None) -> WorkerReport:
        return WorkerReport(self.name, self._processes, self._cases, self._steps, failure, died)

    def failed(self, failure: Failure) -> WorkerReport:
        self.tally.failed(failure)
        return self.report(failure=failure)

    def replayed(self, run: int) -> WorkerReport:
        """The report at the deadline: a failure if the local database replays one."""
        # NOTE: a failure found shortly before the deadline is still being shrunk when the
        # interrupt comes, and pytest then reports no failure: Hypothesis had saved each
        # smaller failing example as it went, so the database has it. Seen on a loaded
        # 2-core machine: both workers of tests/cluster/test_ray_run.py found the planted
        # leak, neither reported it.
        job = self.job
        saved = replay(
            Path(job.source_root),
            job.test_file,
            dict(job.environment),
            None,
            job.local_database,
            timeout_s=GRACE_S,
        )
        if saved.failed:
            steps = "\n\n".join(saved.steps) if saved.steps else _tail(saved.output, 20)
            return self.failed(Failure(saved.failed[0], self.name, run, steps))
        return self.report()

    def died(self, reason: str) -> WorkerReport:
        self.tally.died(self.name)
        return self.report(died=reason)

    def run_pytest(self, run: int, left: float) -> tuple[int, bool, str]:
        """Run pytest once (the worker's ``run``-th): its exit status, whether the deadline
        interrupted it, and its output (also appended to the worker's log)."""
        self._tally_dir.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"worker-{self.name}.log", "a+", encoding="utf-8") as log:
            log.write(f"== worker {self.name} run {run}, {int(left)}s left\n")
            log.flush()
            start = log.tell()
            status, interrupted = self._follow(self._start(log))
            log.seek(start)
            return status, interrupted, log.read()

    def _start(self, log: IO[str]) -> "subprocess.Popen[bytes]":
        environment = {
            **os.environ,
            **dict(self.job.environment),
            "HYPOTHESIS_PROFILE": "fuzz",
            "PAGEDKV_FUZZ_TALLY": str(self._tally_dir),
            SHARED_ENV: self.job.database,
            LOCAL_ENV: self.job.local_database,
        }
        self._processes += 1
        # NOTE: a Ray worker blocks SIGINT, and a child inherits the mask of the thread that
        # starts it: pytest would sleep through the deadline's interrupt. Unblocked for the
        # start only (the worker itself keeps Ray's mask).
        blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            return subprocess.Popen(
                [sys.executable, *PYTEST, "-x", self.job.test_file],
                cwd=self.job.source_root,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _follow(self, process: "subprocess.Popen[bytes]") -> tuple[int, bool]:
        """Tally and beat each second until ``process`` ends; SIGINT at the deadline (and
        every ``INTERRUPT_EVERY_S`` after), SIGKILL ``GRACE_S`` later; on Ctrl-C (the task
        cancelled), stop it first."""
        seen = [0, 0]
        interrupted = False
        next_interrupt = self.job.deadline
        try:
            while process.poll() is None:
                time.sleep(POLL_S)
                self._count(process.pid, seen)
                self.tally.beat(self.name)
                now = time.time()
                if now >= self.job.deadline + GRACE_S:
                    process.kill()
                elif now >= next_interrupt:
                    process.send_signal(signal.SIGINT)
                    interrupted = True
                    next_interrupt = now + INTERRUPT_EVERY_S
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self._count(process.pid, seen)
        return process.returncode, interrupted

    def _count(self, pid: int, seen: list[int]) -> None:
        """Add to the tally what pytest ``pid`` has counted beyond ``seen`` (its last
        cases and steps)."""
        try:
            text = (self._tally_dir / f"{pid}.txt").read_text()
            fields = dict(part.split("=") for part in text.split())
            cases, steps = int(fields["cases"]), int(fields["steps"])
        except (OSError, ValueError, KeyError):  # not written yet, or mid-write
            return
        if (cases, steps) != (seen[0], seen[1]):
            self.tally.add(cases - seen[0], steps - seen[1])
            self._cases += cases - seen[0]
            self._steps += steps - seen[1]
            seen[:] = [cases, steps]


def _steps(output: str) -> str:
    """The shrunk steps of a failure, or the end of pytest's output when it printed none."""
    cases = shrunk_steps(output)
    return "\n\n".join(cases) if cases else _tail(output, 20)


def _tail(output: str, lines: int = 1) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])
