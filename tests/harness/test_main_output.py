"""The main command's output files and Ctrl-C: ``--plot`` checked before the model loads,
written whole or not at all; an interruption is one line, exit 130, nothing half-written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matplotlib.figure import Figure

import harness.figures
import harness.oracle.equivalence
from harness.cli.main import main
from harness.output_files import PLOT_FORMATS, write_replacing
from tests.support.harness_cases import save_model_directory, tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = "prompts.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def argv(tiny_dir: Path, tmp_path: Path) -> list[str]:
    """The tiny model on two prompts (a file in ``tmp_path``), four new tokens each."""
    prompts = tmp_path / PROMPTS
    lines = [{"prompt": "a b c d e f g h"}, {"prompt": "k l m n o"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model = ["--device", "cpu", "--model", str(tiny_dir), "--prompts-file", str(prompts)]
    return [*model, "--max-new-tokens", "4", "--block-size", "4"]


def _last_error(captured: str) -> str:
    assert "Traceback" not in captured
    return captured.strip().splitlines()[-1]


def test_the_plot_formats_are_matplotlibs() -> None:
    assert sorted(PLOT_FORMATS) == sorted(Figure().canvas.get_supported_filetypes())


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("out.txt", "unknown image format 'txt'"),
        ("/proc/x.png", "--plot: cannot write into '/proc'"),
        ("/nonexistent-dir/x.png", "--plot: no directory '/nonexistent-dir' to write into"),
    ],
)
def test_a_plot_that_cannot_be_written_is_refused_before_the_model_loads(
    target: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    # --model points nowhere: reaching the load would be a different error.
    assert main(["--device", "cpu", "--model", "/nowhere", "--plot", target]) == 2
    captured = capsys.readouterr()
    assert message in _last_error(captured.err)
    assert "loading model" not in captured.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("target", "written"), [("plots", "plots/pool_over_time.png"), ("pool", "pool.png")]
)
def test_a_directory_or_a_name_without_extension_says_what_was_written(
    target: str,
    written: str,
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "plots").mkdir()
    plot = tmp_path / target
    assert main([*argv, "--plot", str(plot)]) == 0
    assert f"[harness] wrote {tmp_path / written}" in capsys.readouterr().err
    assert (tmp_path / written).read_bytes().startswith(b"\x89PNG")


def test_a_plot_that_fails_at_the_end_still_prints_the_report_then_one_line(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def disk_full(usage: object, total_blocks: int, path: Path) -> None:
        path.write_bytes(b"half a png")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(harness.figures, "plot_pool_over_time", disk_full)
    assert main([*argv, "--plot", str(tmp_path / "pool.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("RESULT: PASS")
    assert "No space left on device" in _last_error(captured.err)
    assert list(tmp_path.glob("*.png")) == []  # no half file, no temporary file


def test_write_replacing_leaves_the_old_file_when_interrupted(tmp_path: Path) -> None:
    target = tmp_path / "result.json"
    target.write_text("old")

    def interrupted(path: Path) -> None:
        path.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_replacing(target, interrupted)
    assert [path.name for path in tmp_path.iterdir()] == ["result.json"]
    assert target.read_text() == "old"
    write_replacing(target, lambda path: path.write_text("new"))
    assert target.read_text() == "new"


def test_ctrl_c_in_a_stage_is_one_line_and_exit_130_with_nothing_written(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = []
    generate = harness.oracle.equivalence._generate_dense

    def interrupted_second(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(harness.oracle.equivalence, "_generate_dense", interrupted_second)
    plot = tmp_path / "pool.png"
    assert main([*argv, "--plot", str(plot)]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _last_error(captured.err) == (
        "python -m harness: interrupted in dense generate after 1 of 2 requests; nothing written"
    )
    assert [path.name for path in tmp_path.iterdir()] == [PROMPTS]


def test_sigint_to_the_running_command_exits_130_in_one_line(
    argv: list[str], tmp_path: Path
) -> None:
    plot = tmp_path / "pool.png"
    command = [sys.executable, "-m", "harness", *[*argv, "--plot", str(plot)]]
    process = subprocess.Popen(
        [*command, "--max-new-tokens", "400"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert process.stderr is not None
    for line in process.stderr:  # wait until the generation has started
        if "dense generate" in line:
            break
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert out == ""
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m harness: interrupted in ")
    assert err.strip().endswith("; nothing written")
    assert [path.name for path in tmp_path.iterdir()] == [PROMPTS]
