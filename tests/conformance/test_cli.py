"""``python -m harness.conformance`` (and ``pagedkv conformance``): exit 0 when every
property holds, 1 on a discrepancy (with the shrunk steps), 2 on bad input in one line, 130
on Ctrl-C with the steps that completed."""

import subprocess
import sys

import pytest

from harness.cli import pagedkv
from harness.conformance import cli
from harness.conformance.adapter import Adapter
from harness.conformance.targets.article import ArticleBlockManager
from harness.conformance.targets.pagedkv import PagedKVAdapter
from tests.support.planted_bugs import LeaksOneBlockOnRelease


def leaky() -> Adapter:
    """A user's factory (``--target tests.conformance.test_cli:leaky``): a leaking manager."""
    return PagedKVAdapter(manager_class=LeaksOneBlockOnRelease)


class InterruptedArticle(ArticleBlockManager):
    """Ctrl-C arrives during this target's 300th operation of the run."""

    operations = 0

    def allocate(self, request_id: str, token_count: int) -> None:
        self._count()
        super().allocate(request_id, token_count)

    def append_tokens(self, request_id: str, token_count: int) -> None:
        self._count()
        super().append_tokens(request_id, token_count)

    def release(self, request_id: str) -> None:
        self._count()
        super().release(request_id)

    def _count(self) -> None:
        type(self).operations += 1
        if type(self).operations == 300:
            raise KeyboardInterrupt


def test_a_conforming_target_exits_0_with_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", "article", "--steps", "300", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "all properties held" in out and "properties checked: conservation" in out


def test_your_own_factory_by_module_path_exits_1_with_the_shrunk_steps_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--target", "tests.conformance.test_cli:leaky", "--steps", "2000"]) == 1
    out = capsys.readouterr().out
    assert "DISCREPANCY" in out and "property conservation: BUG" in out
    assert "  1. allocate('r0', 1)" in out and "  2. release('r0')" in out


def test_the_console_script_runs_the_kit_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert pagedkv.main(["conformance", "--target", "article", "--steps", "100"]) == 0
    assert "article: " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "nope"], "unknown target 'nope'"),
        (["--target", "no_such_module:make"], "cannot import 'no_such_module'"),
        (["--target", "harness.conformance:nothing"], "has no callable 'nothing'"),
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


def test_ctrl_c_prints_one_line_with_the_steps_completed_and_exits_130(
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = "tests.conformance.test_cli:InterruptedArticle"
    assert cli.main(["--target", target, "--steps", "5000"]) == 130
    # Each of the 299 operations before the interrupted one was a judged step.
    expected = f"{cli.PROG}: interrupted after 299 completed steps"
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected


def test_help_explains_the_modes_and_names_the_targets() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harness.conformance", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    text = done.stdout
    assert "Exact targets" in text and "vllm" in text and "module:factory" in text
    assert "--known-findings" in text and "--steps" in text
