"""``python -m harness.conformance``: exit 0 when every property holds, 1 on a discrepancy
(with the shrunk steps), 2 on bad input in one line, 130 on Ctrl-C."""

import subprocess
import sys

import pytest

from harness.conformance import cli
from harness.conformance.adapter import Adapter
from harness.conformance.targets.pagedkv import PagedKVAdapter
from tests.support.planted_bugs import LeaksOneBlockOnRelease


def test_a_conforming_target_exits_0_with_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", "article", "--steps", "300", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "all properties held" in out and "properties checked: conservation" in out


def test_a_discrepancy_exits_1_with_the_shrunk_steps_side_by_side(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def leaky() -> Adapter:
        return PagedKVAdapter(manager_class=LeaksOneBlockOnRelease)

    monkeypatch.setattr(cli, "CONFIGURATIONS", {"leaky": leaky})
    monkeypatch.setattr(cli, "TARGETS", {"leaky": ("leaky",)})
    assert cli.main(["--target", "leaky", "--steps", "2000"]) == 1
    out = capsys.readouterr().out
    assert "DISCREPANCY" in out and "property conservation: BUG" in out
    assert "  1. allocate('r0', 1)" in out and "  2. release('r0')" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "nope"], "unknown target 'nope'"),
        (["--target", "article", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["--target", "article", "--seed", "x"], "invalid int value: 'x'"),
        ([], "the following arguments are required: --target"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _exit_code(argv: list[str]) -> int:
    """What ``main`` returns, or the code it exits with (argparse's errors exit)."""
    try:
        return cli.main(argv)
    except SystemExit as done:
        assert isinstance(done.code, int)
        return done.code


def test_ctrl_c_prints_one_line_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "check_target", interrupted)
    assert cli.main(["--target", "article"]) == 130
    assert capsys.readouterr().err.strip() == f"{cli.PROG}: interrupted after 0 completed steps"


def test_help_explains_the_modes_and_names_the_targets() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harness.conformance", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "Exact targets" in done.stdout and "vllm" in done.stdout and "--steps" in done.stdout
