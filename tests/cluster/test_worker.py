"""A fuzz worker without Ray (``harness.cluster.worker.fuzz_worker``), its tally in a real
Redis: what it reports when the deadline comes."""

import time
from pathlib import Path

from harness.cluster.shared_database import connect
from harness.cluster.tally import RunTally
from harness.cluster.worker import FuzzJob, fuzz_worker

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "tests/cluster/planted_slow_shrink_target.py"
SECONDS = 40  # pytest's start on a loaded 2-core machine, then the first (failing) case


def test_a_failure_still_being_shrunk_at_the_deadline_is_replayed_and_reported(
    redis_url: str, tmp_path: Path
) -> None:
    tally = RunTally.start(connect(redis_url), "slow-shrink", 1, SECONDS)
    job = FuzzJob(
        source_root=str(ROOT),
        test_file=PLANTED,
        target="slow-shrink",
        database=redis_url,
        run_id=tally.run_id,
        deadline=time.time() + SECONDS,
        logs=str(tmp_path / "logs"),
        local_database=str(tmp_path / "db"),
    )
    report = fuzz_worker(job, 1)
    log = (tmp_path / "logs" / "worker-w1.log").read_text()
    assert "FAILED" not in log, log  # the search itself reported nothing
    assert report.failure is not None, log
    assert report.failure.test == f"{PLANTED}::test_fails_and_shrinks_past_any_deadline"
    assert "planted: fails for every x" in report.failure.steps
    assert (report.failure.worker, report.failure.run, report.died) == ("w1", 1, None)
    assert tally.failures() == [report.failure]
