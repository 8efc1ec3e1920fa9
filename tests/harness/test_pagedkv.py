"""The ``pagedkv`` console script: a dispatcher over the main command, the benchmarks and
fuzzing, with their options and exit codes."""

import contextlib
import importlib
import os
import sys
from pathlib import Path

import pytest

import harness.bench.fragmentation
import harness.cli.fuzz
from harness.cli.main import main as harness_main
from harness.cli.pagedkv import BENCHMARKS, main
from harness.cluster.shared_database import LOCAL_ENV
from tests.support.processes import (
    child_session,
    ctrl_c,
    left_after,
    own_session,
    wait_for_command,
)

CONSOLE_SCRIPT = str(Path(sys.executable).parent / "pagedkv")
STARTUP_S = 60  # the console script, then the script's first pytest, on a loaded machine


def test_help_at_the_top_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {command}" in out for command in ("check", "bench NAME", "fuzz"))
    assert main([]) == 2
    assert "usage: pagedkv COMMAND" in capsys.readouterr().err


def test_an_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chek"]) == 2
    assert capsys.readouterr().err == (
        "pagedkv: error: unknown command 'chek' (expected check, bench, fuzz or conformance)\n"
    )


def test_check_is_the_main_command_under_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--device", "tpu"]) == harness_main(["--device", "tpu"]) == 2
    first, second = capsys.readouterr().err.splitlines()
    assert first == second.replace("python -m harness", "pagedkv check")
    with pytest.raises(SystemExit) as exited:
        main(["check", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: pagedkv check [-h] [--model MODEL]")


def test_every_listed_benchmark_has_a_main() -> None:
    for module, _ in BENCHMARKS.values():
        assert callable(importlib.import_module(module).main)


def test_bench_runs_the_named_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--request-tokens", "9,17,33"]
    assert main(["bench", "fragmentation", *argv]) == 0
    through_pagedkv = capsys.readouterr().out
    assert harness.bench.fragmentation.main(argv) == 0
    assert through_pagedkv == capsys.readouterr().out != ""


def test_bench_help_and_bad_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in BENCHMARKS)
    assert main(["bench", "nope"]) == 2
    assert capsys.readouterr().err.startswith("pagedkv bench: error: unknown benchmark 'nope'")


def test_ctrl_c_in_a_benchmark_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(harness.bench.fragmentation, "main", interrupted)
    assert main(["bench", "fragmentation"]) == 130
    assert capsys.readouterr().err == "pagedkv bench fragmentation: interrupted\n"


@pytest.mark.parametrize("argv", [["0"], ["10", "0"], ["ten"]])
def test_fuzz_refuses_bad_counts_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) if argv == ["ten"] else contextlib.nullcontext():
        assert main(["fuzz", *argv]) == 2
    assert capsys.readouterr().err.startswith("pagedkv fuzz: error: ")


def test_fuzz_outside_a_source_checkout_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness.cli.fuzz, "SOURCE_ROOT", tmp_path)
    assert main(["fuzz", "5"]) == 2
    assert capsys.readouterr().err == (
        "pagedkv fuzz: error: needs a source checkout: no scripts/fuzz.sh and "
        f"tests/support/fuzz_targets.py under {tmp_path}\n"
    )


def test_fuzz_runs_the_script_and_ctrl_c_stops_it_in_one_line() -> None:
    command = [CONSOLE_SCRIPT, "fuzz", "120", "1"]
    with own_session(command, {**os.environ, "OMP_NUM_THREADS": "1"}) as process:
        script = child_session(process.pid, STARTUP_S)  # scripts/fuzz.sh opens its own
        wait_for_command({script}, "pytest", STARTUP_S)
        err = ctrl_c(process, timeout_s=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pagedkv fuzz: interrupted after ")
    assert last.endswith(
        " of 120 s; logs kept in .hypothesis/fuzz-logs/, failing cases found "
        "so far in .hypothesis/fuzz-db"
    )
    # Only what this test started: another fuzz run in the same checkout is none of its business.
    assert left_after({process.pid, script}, timeout_s=1) == []


def test_ctrl_c_during_a_replay_is_one_line_and_leaves_nothing_running(tmp_path: Path) -> None:
    environment = {**os.environ, LOCAL_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    with own_session([CONSOLE_SCRIPT, "fuzz", "--replay"], environment) as process:
        wait_for_command({process.pid}, "pytest", STARTUP_S)  # the replay's, in its session
        err = ctrl_c(process, timeout_s=120)  # reaching the replay's pytest too
    assert (process.returncode, err) == (130, "pagedkv fuzz: interrupted\n")
    assert left_after({process.pid}, timeout_s=5) == []
