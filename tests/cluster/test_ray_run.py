"""Two fuzz workers on a real local Ray cluster, sharing a real Redis, against a planted bug.

One of them finds the bug; a later run on another "machine" (a fresh local database)
replays it from Redis without searching; the tally in Redis is the sum of what each
worker counted. The cluster listens on loopback only, and is stopped at the end.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import harness.cli.fuzz
from harness.cli.fuzz import FuzzTarget
from harness.cluster import ray_run
from harness.cluster.replay import replay
from harness.cluster.shared_database import LOCAL_ENV, connect
from harness.cluster.tally import RunTally
from harness.cluster.worker import FuzzJob

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "tests/cluster/planted_fuzz_target.py"
PLANTED_TEST = f"{PLANTED}::TestFuzzLeaksOneBlockOnRelease::runTest"
SECONDS = 150  # the bound; the bug is found within the first test cases


@pytest.fixture
def local_ray(ray_installed: None) -> Iterator[None]:
    """``ray.init(num_cpus=2)`` on loopback addresses, shut down after the test."""
    import ray  # noqa: PLC0415

    ray_run.start_local_cluster(2)
    try:
        yield
    finally:
        ray.shutdown()


def test_one_worker_finds_a_planted_bug_another_run_replays_it_from_redis_and_the_tally_adds_up(
    redis_url: str,
    local_ray: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import ray  # noqa: PLC0415

    assert ray.util.get_node_ip_address() == "127.0.0.1"  # type: ignore[no-untyped-call]
    tally = RunTally.start(connect(redis_url), "planted", 2, SECONDS)
    job = FuzzJob(
        source_root=str(ROOT),
        test_file=PLANTED,
        target="planted",
        database=redis_url,
        run_id=tally.run_id,
        deadline=time.time() + SECONDS,
        logs=str(tmp_path / "logs"),
        local_database=str(tmp_path / "finder-db"),
    )
    reports = ray_run.run_workers(job, 2, tally, follow=lambda ended: None)

    found = [report.failure for report in reports if report.failure]
    assert found, f"no worker found the planted bug: {reports}"
    assert sorted(tally.failures(), key=lambda failure: failure.worker) == found
    for failure in found:
        assert failure.test == PLANTED_TEST
        assert failure.steps.startswith("AssertionError")
        assert "state.init_pool(" in failure.steps
        assert failure.steps.endswith("state.teardown()")
    totals = tally.totals()
    assert [report.worker for report in reports] == ["w1", "w2"]
    assert all(report.cases > 0 and report.died is None for report in reports)
    assert totals.cases == sum(report.cases for report in reports)
    assert totals.steps == sum(report.steps for report in reports)
    assert (totals.failures, totals.died, totals.alive) == (len(found), 0, 0)

    # Elsewhere, with an empty local database: the failure comes from Redis, and stays.
    elsewhere = replay(ROOT, PLANTED, {}, redis_url, str(tmp_path / "elsewhere-db"))
    assert elsewhere.status == 1, elsewhere.output
    assert elsewhere.failed == [PLANTED_TEST]
    assert any(case.startswith("AssertionError") for case in elsewhere.steps)
    assert any((tmp_path / "elsewhere-db").iterdir()), "the replay kept no local copy"
    # The same through `pagedkv fuzz --replay`, on a third "machine".
    monkeypatch.setattr(
        harness.cli.fuzz, "fuzz_target", lambda name: FuzzTarget("planted", PLANTED)
    )
    monkeypatch.setenv(LOCAL_ENV, str(tmp_path / "third-db"))
    assert harness.cli.fuzz.main(["--replay", "--database", redis_url]) == 1
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == f"FAILED {PLANTED_TEST}"
    assert shown[1].startswith("AssertionError") and "state.teardown()" in shown
    assert shown[-1] == (
        f"pagedkv fuzz: 1 test(s) of planted fail on cases saved in {tmp_path / 'third-db'} "
        f"and {redis_url}"
    )
    # A replay does not search: on an empty database it finds nothing, where a search
    # finds this bug within seconds.
    empty_redis = redis_url.removesuffix("/0") + "/1"
    nothing = replay(ROOT, PLANTED, {}, empty_redis, str(tmp_path / "empty-db"))
    assert (nothing.status, nothing.failed) == (0, []), nothing.output
