"""Redis killed in the middle of a fuzzing run, on the plain path (``scripts/fuzz.sh``) and on
Ray: the run goes on with the local example database, says so in one line, and still
reports a failure with its falsifying example; the exit status is that of the workers."""

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

import harness.cli.fuzz
from harness.cli.fuzz import FuzzTarget
from harness.cluster.redis_server import LoopbackRedis
from harness.cluster.shared_database import LOCAL_ENV, redis_client
from harness.cluster.tally import recent_runs
from tests.support.processes import child_session, own_session, wait_for_command

CONSOLE_SCRIPT = str(Path(sys.executable).parent / "pagedkv")
PLANTED = "tests/cluster/planted_fuzz_target.py"
PLANTED_TEST = f"{PLANTED}::TestFuzzLeaksOneBlockOnRelease::runTest"
STARTUP_S = 180  # a local Ray cluster, or the script's first pytest, on a loaded machine
SECONDS = 30


def _lost_line(prog: str, url: str, local: str) -> re.Pattern[str]:
    return re.compile(
        rf"{prog}: {re.escape(url)}: connection lost at \d+ s \(.+\); going on with the "
        rf"local database {re.escape(local)}"
    )


def test_the_plain_path_goes_on_without_redis_in_one_line(
    redis_server: LoopbackRedis, tmp_path: Path
) -> None:
    local = str(tmp_path / "fuzz-db")
    command = [CONSOLE_SCRIPT, "fuzz", str(SECONDS), "1", "--database", redis_server.url]
    environment = {**os.environ, LOCAL_ENV: local, "OMP_NUM_THREADS": "1"}
    with own_session(command, environment) as run:
        script = child_session(run.pid, STARTUP_S)
        wait_for_command({script}, "pytest", STARTUP_S)
        time.sleep(3)  # its pytest reads its saved cases from Redis first
        redis_server.kill()
        _, err = run.communicate(timeout=SECONDS + STARTUP_S)
    assert run.returncode == 0, err
    lines = err.strip().splitlines()
    lost = [line for line in lines if "connection lost" in line]
    assert len(lost) == 1 and _lost_line("fuzz", redis_server.url, local).fullmatch(lost[0]), err
    assert "Traceback" not in err and "FAILURE" not in err


def test_on_ray_a_failure_found_after_redis_is_lost_is_reported_with_its_steps(
    redis_server: LoopbackRedis,
    ray_installed: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(
        harness.cli.fuzz, "fuzz_target", lambda name: FuzzTarget("planted", PLANTED)
    )
    local = str(tmp_path / "fuzz-db")
    monkeypatch.setenv(LOCAL_ENV, local)
    killer = threading.Thread(target=_kill_once_a_worker_is_alive, args=(redis_server,))
    killer.start()
    try:
        argv = ["--ray", "--workers", "1", "--seconds", "150", "--database", redis_server.url]
        status = harness.cli.fuzz.main(argv)
    finally:
        killer.join()
    out, err = capsys.readouterr()
    assert status == 1, err
    assert out.startswith(f"worker w1 (run 1): FAILURE in {PLANTED_TEST}\nAssertionError")
    assert "state.init_pool(" in out and out.rstrip().endswith("state.teardown()")
    lines = err.strip().splitlines()
    lost = [line for line in lines if "connection lost" in line]
    expected = _lost_line("pagedkv fuzz", redis_server.url, f"{local} on each machine")
    assert len(lost) == 1 and expected.fullmatch(lost[0]), err
    assert lines[-1].startswith("pagedkv fuzz: run ") and "(planted, finished): 0 of 1" in err
    assert ", 0 died, " in lines[-1] and ", 1 failure, " in lines[-1]
    assert "Traceback" not in err and "ConnectionError" not in err
    assert any(Path(local).iterdir()), "the failure was not kept in the local database"


def _kill_once_a_worker_is_alive(server: LoopbackRedis) -> None:
    """Kill Redis as soon as the run's worker has said it is alive there (mid-run: before its
    pytest has started, so that pytest finds Redis gone and goes on without it)."""
    redis = redis_client(server.url)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        runs = recent_runs(redis, 1)
        if runs and runs[0].totals().alive:
            break
        time.sleep(0.2)
    server.kill()
