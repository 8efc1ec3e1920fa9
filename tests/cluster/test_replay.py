"""``python -m harness.cluster.replay``, the replay at the end of ``scripts/fuzz.sh``: a case
saved in the local database fails again (exit 1, with pytest's output), an empty database
replays nothing (exit 0)."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness.cluster.replay import main
from harness.cluster.shared_database import LOCAL_ENV

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "tests/cluster/planted_slow_shrink_target.py"
PLANTED_TEST = f"{PLANTED}::test_fails_and_shrinks_past_any_deadline"

# Its search, in a process of its own (the target's module takes SIGINT over): it fails on
# every input, and Hypothesis saves the failing case in the directory database it is given.
SAVE_A_FAILURE = """
import sys
from hypothesis import Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from tests.cluster import planted_slow_shrink_target as planted
search = settings(
    database=DirectoryBasedExampleDatabase(sys.argv[1]), phases=[Phase.generate, Phase.shrink]
)
try:
    search(planted.test_fails_and_shrinks_past_any_deadline)()
except AssertionError:
    sys.exit(0)
sys.exit("the planted target did not fail")
"""


@pytest.fixture
def local_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty local example database, the one a replay from the checkout reads."""
    monkeypatch.setenv(LOCAL_ENV, str(tmp_path))
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)  # the search's: not fuzz's
    monkeypatch.chdir(ROOT)
    return tmp_path


def test_a_saved_failing_case_fails_again_with_exit_1(
    local_database: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = subprocess.run(
        [sys.executable, "-c", SAVE_A_FAILURE, str(local_database)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert saved.returncode == 0, saved.stderr
    assert main([PLANTED, "--timeout", "120"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {PLANTED_TEST}" in out
    assert "planted: fails for every x" in out


def test_an_empty_database_replays_nothing_with_exit_0(
    local_database: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([PLANTED, "--timeout", "120"]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_a_timeout_below_one_second_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([PLANTED, "--timeout", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m harness.cluster.replay: error: argument --timeout: ")
    assert err.count("\n") == 1, err
