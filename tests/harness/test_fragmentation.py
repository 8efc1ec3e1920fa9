"""The seed benchmark: the article's fragmentation figures, and one-line errors on bad input."""

import json
import subprocess
import sys

import pytest

from harness.bench.fragmentation import fragmentation_report, main
from impl.block_map import LEGEND

ARTICLE_ARGS = ["--block-size", "16", "--total-blocks", "64"]
ARTICLE_ARGS += ["--request-tokens", "9,17,33,5,41,12"]


def test_the_command_prints_the_articles_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARTICLE_ARGS) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["block_size"] == 16
    assert report["request_tokens"] == [9, 17, 33, 5, 41, 12]
    usage = report["block_usage"]
    assert usage["allocated_tokens"] == 117
    assert usage["reserved_tokens"] == 176
    assert usage["internal_fragmentation_tokens"] == 59
    assert usage["used_blocks"] == 11
    assert usage["free_blocks"] == 53
    assert usage["block_utilization"] == 0.6647727272727273
    baseline = report["contiguous_fixed_slot_baseline"]
    assert baseline["reserved_tokens"] == 246
    assert baseline["internal_fragmentation_tokens"] == 129
    assert baseline["utilization"] == 0.47560975609756095
    assert report["fragmentation_tokens_saved_vs_contiguous"] == 70


def test_one_block_size_makes_paging_waste_nothing() -> None:
    report = fragmentation_report(1, 100, [3, 7, 1])
    assert report["block_usage"] == {
        "block_size": 1,
        "total_blocks": 100,
        "used_blocks": 11,
        "free_blocks": 89,
        "request_count": 3,
        "allocated_tokens": 11,
        "reserved_tokens": 11,
        "internal_fragmentation_tokens": 0,
        "block_utilization": 1.0,
    }
    assert report["fragmentation_tokens_saved_vs_contiguous"] == 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--request-tokens", ""], "comma-separated list"),
        (["--request-tokens", "4,0"], "needs >= 1 token, got 0"),
        (["--request-tokens", "4,-3"], "needs >= 1 token, got -3"),
        (["--request-tokens", "4,x"], "'x' is not a whole number"),
        (["--total-blocks", "2"], "pool of 2 blocks is too small"),
        (["--block-size", "0"], "argument --block-size: must be in [1, 65,536], got 0"),
        (["--total-blocks", "zero"], "invalid int value"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harness.bench.fragmentation", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr
    assert "Traceback" not in done.stderr


def test_the_map_option_draws_the_articles_example_block_by_block(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*ARTICLE_ARGS, "--map"]) == 0
    lines = capsys.readouterr().out.splitlines()
    free = ", ".join(str(block_id) for block_id in range(11, 64))
    assert lines == [
        "pool: 64 blocks x 16 tokens; 11 used (0 shared), 0 cached free, 53 free",
        " 0 [A ~][B  ][B ~][C  ][C  ][C ~][D ~][E  ][E  ][E ~][F ~][.  ][.  ][.  ][.  ]",
        "15 " + "[.  ]" * 15,
        "30 " + "[.  ]" * 15,
        "45 " + "[.  ]" * 15,
        "60 " + "[.  ]" * 4,
        "A  request-0: token_count = 9, block_ids = [0]",
        "B  request-1: token_count = 17, block_ids = [1, 2]",
        "C  request-2: token_count = 33, block_ids = [3, 4, 5]",
        "D  request-3: token_count = 5, block_ids = [6]",
        "E  request-4: token_count = 41, block_ids = [7, 8, 9]",
        "F  request-5: token_count = 12, block_ids = [10]",
        f"free_block_ids = [{free}]",
        "cached_free_block_ids = []",
        LEGEND,
    ]
