"""``python -m harness.tiny_models``: a tiny seeded model saved as a directory, or one line
and exit 2 (issue 49, item 6: a destination that is a file exited 0 having written nothing,
a seed of ``abc`` or an unwritable destination was a traceback, ``--help`` exited 2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from harness.tiny_models import main

PROG = "python -m harness.tiny_models"


def test_help_explains_the_arguments_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harness.tiny_models", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {PROG} [-h] ARCHITECTURE DIRECTORY [SEED]")
    assert "lfm2" in done.stdout and "--model DIRECTORY" in done.stdout


def test_a_saved_model_is_a_directory_the_command_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "lfm2"
    assert main(["lfm2", str(directory), "7"]) == 0
    assert capsys.readouterr().out == f"saved tiny lfm2 (seed 7) to {directory}\n"
    assert AutoConfig.from_pretrained(directory).model_type == "lfm2"
    assert (directory / "tokenizer.json").is_file()
    # Nothing but the model's files: the temporary directory it was written in is gone.
    assert [path.name for path in directory.parent.iterdir()] == ["lfm2"]


def test_an_existing_directory_gets_the_model_beside_its_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("kept")
    assert main(["llama", str(tmp_path)]) == 0
    assert (tmp_path / "notes.txt").read_text() == "kept"
    assert AutoConfig.from_pretrained(tmp_path).model_type == "llama"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: ARCHITECTURE, DIRECTORY"),
        (["lfm2"], "the following arguments are required: DIRECTORY"),
        (["lfm2", "d", "1", "2"], "unrecognized arguments: 2"),
        (["mamba", "d"], "argument ARCHITECTURE: invalid choice: 'mamba' (choose from 'llama', "),
        (["lfm2", "d", "abc"], "argument SEED: invalid int value: 'abc'"),
        (["lfm2", "d", "-1"], "argument SEED: must be in [0, 18,446,744,073,709,551,615], got -1"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # "d": a destination that must not be written
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"{PROG}: error: {message}")
    assert not (tmp_path / "d").exists()


def test_a_destination_that_is_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    destination = tmp_path / "FILE"
    destination.write_text("mine")
    assert main(["lfm2", str(destination)]) == 2
    assert capsys.readouterr().err == (
        f"{PROG}: error: {str(destination)!r} exists and is not a directory\n"
    )
    assert destination.read_text() == "mine"


def test_a_destination_in_no_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "FILE").write_text("mine")
    for parent in (tmp_path / "missing", tmp_path / "FILE"):
        assert main(["lfm2", str(parent / "lfm2")]) == 2
        assert capsys.readouterr().err == (
            f"{PROG}: error: no directory {str(parent)!r} to write {str(parent / 'lfm2')!r} into\n"
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["FILE"]


def test_a_destination_that_cannot_be_written_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # /proc: a directory no one can create a directory in, root included (whom permissions
    # would let write anywhere else).
    assert main(["lfm2", "/proc/lfm2"]) == 2
    assert capsys.readouterr().err == (
        f"{PROG}: error: cannot write '/proc/lfm2': No such file or directory\n"
    )
