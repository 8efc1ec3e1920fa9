"""The seed benchmark: the article's fragmentation figures, and one-line errors on bad input."""

import json
import subprocess
import sys

import pytest

from harness.bench.fragmentation import fragmentation_report, main

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
        (["--block-size", "0"], "block_size must be at least 1"),
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
