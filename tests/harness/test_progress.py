"""Progress on stderr: bars with counts and rate on a terminal, lines otherwise."""

import io
import sys

import pytest

from harness.progress import Progress, stderr_as_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress("[harness]", stream, bar=False)
    progress("loading model")
    progress("dense generate: request 1/2")
    progress("dense generate: request 2/2")
    progress.finish()
    assert stream.getvalue() == (
        "[harness] loading model\n"
        "[harness] dense generate: request 1/2\n"
        "[harness] dense generate: request 2/2\n"
    )


def test_a_bar_counts_a_stage_on_one_redrawn_line_with_its_rate() -> None:
    stream = io.StringIO()
    progress = Progress("[harness]", stream, bar=True)
    for number in (1, 2, 3):
        progress(f"dense generate: request {number}/3")
    progress("paged, continuous batching (gather): 3 requests")
    lines = stream.getvalue().split("\n")
    # One line for the stage, redrawn in place (\r), ending at 3/3; then the next message.
    assert len(lines) == 3 and lines[2] == ""
    redraws = lines[0].split("\r\x1b[K")[1:]
    assert [draw.split("| ")[1].split(" ")[0] for draw in redraws] == ["0/3", "1/3", "2/3", "3/3"]
    assert redraws[0].startswith("[harness] dense generate |" + "-" * 24 + "| 0/3 ")
    assert redraws[-1].startswith("[harness] dense generate |" + "#" * 24 + "| 3/3 ")
    assert redraws[-1].endswith("/s")
    assert lines[1] == "[harness] paged, continuous batching (gather): 3 requests"


def test_a_new_stage_starts_a_new_bar() -> None:
    stream = io.StringIO()
    progress = Progress("[p]", stream, bar=True)
    progress("dense generate: request 1/1")
    progress("paged, one request alone: request 1/1")
    progress.finish()
    lines = stream.getvalue().split("\n")
    assert "dense generate |" in lines[0] and "paged, one request alone |" in lines[1]
    assert lines[2] == ""


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([], "before starting"),
        (["loading model"], "while loading model"),
        (
            ["loading model", "dense generate: request 3/14"],
            "in dense generate after 2 of 14 requests",
        ),
        (["fuzzing: second 5/60"], "in fuzzing after 4 of 60 seconds"),
    ],
)
def test_where_says_how_far_the_work_got(messages: list[str], where: str) -> None:
    progress = Progress("[p]", io.StringIO(), bar=False)
    for message in messages:
        progress(message)
    assert progress.where() == where


def test_bars_only_on_a_terminal_and_never_under_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert Progress.for_stderr("[p]").is_bar
    assert not Progress.for_stderr("[p]", plain=True).is_bar
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not Progress.for_stderr("[p]").is_bar


def test_benchmark_stage_lines_become_bars_on_a_terminal_and_the_rest_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with stderr_as_progress():
        print("  impl: run 1/2", file=sys.stderr)
        print("  impl: run 2/2", file=sys.stderr)
        print("python -m harness.bench.x: error: one line", file=sys.stderr)
    assert sys.stderr is terminal
    lines = terminal.getvalue().split("\n")
    assert "\r\x1b[Kimpl |" in lines[0] and lines[0].endswith("/s")
    assert lines[0].split("\r\x1b[K")[-1].split("| ")[1].startswith("2/2 ")
    assert lines[1:] == ["python -m harness.bench.x: error: one line", ""]


def test_benchmark_stderr_is_left_alone_when_piped(monkeypatch: pytest.MonkeyPatch) -> None:
    piped = io.StringIO()
    monkeypatch.setattr("sys.stderr", piped)
    with stderr_as_progress():
        print("  impl: run 1/2", file=sys.stderr)
    assert piped.getvalue() == "  impl: run 1/2\n"


def test_stages_taking_turns_end_their_bars_at_what_was_done_not_at_the_total() -> None:
    stream = io.StringIO()
    progress = Progress("", stream, bar=True)
    progress("impl: run 1/3")
    progress("spec: run 1/3")
    progress("impl: run 2/3")
    progress.finish()
    finals = [line.split("\r\x1b[K")[-1] for line in stream.getvalue().split("\n")[:3]]
    assert [final.split("| ")[1].split(" ")[0] for final in finals] == ["1/3", "1/3", "2/3"]
    assert finals[2].startswith("impl |")
