"""Two fuzz workers on a real local Ray cluster, sharing a real Redis, against a planted bug.

One of them finds the bug; a later run on another "machine" (a fresh local database)
replays it from Redis without searching; the tally in Redis is the sum of what each
worker counted. The cluster listens on loopback only, and is stopped at the end.
"""

import os
import socket
import sys
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
from tests.support.processes import ctrl_c, left_after, own_session, wait_for_command

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "pagedkv")
STARTUP_S = 180  # a local Ray cluster, on a loaded 2-core machine
# Ray's agents (children of the raylet) lived ~65 s after a Ctrl-C that cut ray.init short.
STOPPED_S = 30
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


@pytest.mark.parametrize("ray", [["--ray"], ["--ray", "auto"]], ids=["local", "auto"])
def test_a_ray_address_in_the_environment_that_answers_nothing_is_one_line(
    ray: list[str],
    redis_url: str,
    ray_installed: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", nowhere)
    assert harness.cli.fuzz.main([*ray, "--database", redis_url]) == 2
    err = capsys.readouterr().err
    said = f"pagedkv fuzz: error: cannot reach the Ray cluster at {nowhere} (RAY_ADDRESS): "
    assert err.startswith(said) and err.count("\n") == 1, err


def test_ctrl_c_while_ray_starts_leaves_no_process_of_the_run(
    redis_url: str, ray_installed: None
) -> None:
    command = [CONSOLE_SCRIPT, "fuzz", "--ray", "--workers", "1", "--database", redis_url]
    # In its own session: everything Ray starts for it stays there.
    with own_session(command, {**os.environ, "OMP_NUM_THREADS": "1"}) as driver:
        # Ray is half-way: the raylet has started its agents, ray.init has not returned.
        wait_for_command({driver.pid}, "Agent", STARTUP_S)
        err = ctrl_c(driver, timeout_s=STARTUP_S)
    assert driver.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("pagedkv fuzz: interrupted")
    assert left_after({driver.pid}, STOPPED_S) == []
