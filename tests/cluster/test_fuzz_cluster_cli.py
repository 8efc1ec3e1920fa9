"""``pagedkv fuzz --ray | --status | --replay`` as a user runs them, on a real local Ray
cluster and a real Redis: the live tally, a worker killed mid-run counted dead, Ctrl-C
stopping every task; bad input refused in one line before any worker starts."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.cli.fuzz import main
from harness.cluster.shared_database import LOCAL_ENV, VERSION_KEY, connect, redis_client
from harness.cluster.tally import RUNS, RunTotals, recent_runs
from tests.support.processes import ctrl_c, in_sessions, own_session

if TYPE_CHECKING:
    from redis import Redis

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "pagedkv")
STARTUP_S = 180  # a local Ray cluster and two pytest processes, on a loaded 2-core machine


def test_a_run_shows_its_tally_counts_a_killed_worker_dead_and_ctrl_c_stops_every_task(
    redis_url: str, ray_installed: None
) -> None:
    options = ["--workers", "2", "--seconds", "600", "--database", redis_url]
    command = [CONSOLE_SCRIPT, "fuzz", "--ray", *options]
    # Its own session: Ray's processes and the workers' pytest stay in it, told apart from
    # any other run's; Ctrl-C reaches a terminal's whole foreground group.
    with own_session(command, {**os.environ, "OMP_NUM_THREADS": "1"}) as driver:
        redis = connect(redis_url)
        running = _wait_for(redis, lambda t: t.alive == 2 and _both_fuzzing(t.run_id))
        assert running.target == "allocator"

        shown = _pagedkv("fuzz", "--status", "--database", redis_url)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"run {running.run_id} (allocator, running): 2 of 2 ")

        killed = _fuzz_processes(driver.pid)[0]
        os.kill(_parent(killed), signal.SIGKILL)  # its Ray worker: as the OOM killer would
        dead = _wait_for(redis, lambda t: t.died == 1)
        assert dead.alive == 1
        _wait_gone(killed)  # it died with its worker, not left to fuzz on

        err = ctrl_c(driver, timeout_s=120)
    assert driver.returncode == 130, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert any(line.startswith("pagedkv fuzz: worker w") and " died: " in line for line in lines)
    assert lines[-1].startswith("pagedkv fuzz: interrupted; every worker stopped. run ")
    ended = recent_runs(redis, 1)[0].totals()
    assert (ended.state, ended.alive, ended.died) == ("interrupted", 0, 1)
    assert f"{ended.cases:,} test cases, {ended.steps:,} steps" in lines[-1]
    time.sleep(1)
    assert _fuzz_processes(driver.pid) == []
    # The survivor's pytest took the interrupt and stopped cleanly (a Ray worker blocks
    # SIGINT, and pytest would inherit that), rather than being killed STOP_S later.
    logs = (ROOT / ".hypothesis" / "fuzz-logs" / ended.run_id).glob("worker-*.log")
    assert any("!!! KeyboardInterrupt" in log.read_text() for log in logs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--ray", "--workers", "0"],
        ["--ray", "--workers", "-3"],
        ["--ray", "--seconds", "0"],
        ["--ray"],
        ["--status"],
        ["--ray", "--replay"],
        ["--target", "nope"],
    ],
    ids=[
        "no-workers",
        "negative-workers",
        "no-seconds",
        "ray-no-db",
        "status-no-db",
        "two-modes",
        "unknown-target",
    ],
)
def test_bad_options_are_one_line_before_anything_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv fuzz: error: ") and err.count("\n") == 1, err


def test_an_unreachable_redis_or_ray_is_one_line_before_any_worker_starts(
    redis_url: str, ray_installed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = _closed_port()
    for argv in (["--ray"], ["5", "1"]):  # on Ray, and through scripts/fuzz.sh
        assert main([*argv, "--database", f"redis://127.0.0.1:{closed}/0"]) == 2
        err = capsys.readouterr().err
        said = f"pagedkv fuzz: error: cannot reach Redis at redis://127.0.0.1:{closed}/0: "
        assert err.startswith(said) and err.count("\n") == 1, err
    for address in (f"ray://127.0.0.1:{closed}", f"127.0.0.1:{closed}", "nowhere"):
        assert main(["--ray", address, "--database", redis_url]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pagedkv fuzz: error: ") and err.count("\n") == 1, err
        assert f"{address}" in err
    assert redis_client(redis_url).zcard(RUNS) == 0


def test_a_database_of_another_hypothesis_version_is_refused_everywhere(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    redis_client(redis_url).set(VERSION_KEY, "6.123.0")
    said = (
        f"the database at {redis_url} holds examples of Hypothesis 6.123.0, this is "
        "Hypothesis 6.170.15: run every worker on one version"
    )
    # (bounded, should the refusal fail: a run would start)
    for argv in (["--ray", "--seconds", "5", "--workers", "1"], ["--replay"], ["--status"]):
        assert main([*argv, "--database", redis_url]) == 2
        assert capsys.readouterr().err.startswith(f"pagedkv fuzz: error: {said}")
    script = subprocess.run(
        ["bash", "scripts/fuzz.sh", "--database", redis_url, "3", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert script.returncode == 2
    assert script.stderr.startswith(f"fuzz: error: {said}") and script.stderr.count("\n") == 1
    assert redis_client(redis_url).zcard(RUNS) == 0


def test_status_and_replay_on_an_empty_database(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(LOCAL_ENV, str(tmp_path))
    assert main(["--status", "--database", redis_url]) == 0
    assert capsys.readouterr().out == f"pagedkv fuzz: no run recorded in {redis_url}\n"
    assert main(["--replay", "--database", redis_url]) == 0
    assert capsys.readouterr().out == (
        f"pagedkv fuzz: no saved failing case of allocator fails ({tmp_path} and {redis_url})\n"
    )


def test_target_runs_the_conformance_machine_through_the_script() -> None:
    done = _pagedkv("fuzz", "--target", "pagedkv", "15", "1", timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("fuzz: 1 worker(s) for 15s on the conformance target pagedkv, ")
    summary = done.stdout.split(
        ", "
    )  # fuzz: 1 worker(s), S s, P process(es), C test cases, N steps
    assert summary[0] == "fuzz: 1 worker(s)" and int(summary[3].removesuffix(" test cases")) > 0


def _pagedkv(*argv: str, timeout: int = 60) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        [CONSOLE_SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def _wait_for(redis: "Redis", reached: Callable[[RunTotals], bool]) -> RunTotals:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        runs = recent_runs(redis, 1)
        if runs and reached(totals := runs[0].totals()):
            return totals
        time.sleep(0.5)
    raise AssertionError(f"the run never got there: {runs[0].totals() if runs else 'no run'}")


def _both_fuzzing(run_id: str) -> bool:
    """Whether each worker's pytest has tallied its first test cases (so it is past its
    start, fuzzing)."""
    tallies = ROOT / ".hypothesis" / "fuzz-logs" / run_id
    return all(any((tallies / f"tally-w{n}").glob("*.txt")) for n in (1, 2))


def _fuzz_processes(session: int) -> list[int]:
    """The pytest processes of ``session`` (the driver's), never another run's."""
    return sorted(process.pid for process in in_sessions({session}) if "pytest" in process.command)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid), f"pytest {pid} outlived its worker"


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_run_in_which_no_worker_fuzzed_says_so_in_one_line_and_fails() -> None:
    # 0 seconds: no worker starts pytest, so no tally is written. The summary used to read
    # the missing tallies under pipefail and end the script with status 1 and no word.
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [str(root / "scripts" / "fuzz.sh"), "0", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        "fuzz: no worker finished a test run in 0s, so nothing was fuzzed (see .hypothesis/"
    ), done.stderr
