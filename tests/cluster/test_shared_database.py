"""The shared example database on a real ``redis-server``: the database number of its URL,
and Redis killed while Hypothesis is using it."""

from pathlib import Path

import hypothesis
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from harness.cli.fuzz import main
from harness.cluster.redis_server import LoopbackRedis
from harness.cluster.shared_database import (
    LOCAL_ENV,
    SHARED_ENV,
    VERSION_KEY,
    fuzz_database,
    redis_client,
)


@pytest.mark.parametrize("number", ["x", "3/4", "-1"])
def test_a_database_number_that_is_not_one_is_refused_in_one_line(
    number: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = redis_url.removesuffix("/0") + f"/{number}"
    for argv in (["--status"], ["5", "1"]):  # the tally, and through scripts/fuzz.sh
        assert main([*argv, "--database", url]) == 2
        assert capsys.readouterr().err == (
            f"pagedkv fuzz: error: the database number in {url!r} must be an integer >= 0 "
            f"(redis://HOST:PORT/N), got {number!r}\n"
        )
    assert redis_client(redis_url).dbsize() == 0  # not database 0 instead (redis-py's reading)


def test_the_keys_of_redis_url_slash_3_land_in_database_3(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    third = redis_url.removesuffix("/0") + "/3"
    assert main(["--status", "--database", third]) == 0
    assert capsys.readouterr().out == f"pagedkv fuzz: no run recorded in {third}\n"
    assert redis_client(third).get(VERSION_KEY) == hypothesis.__version__.encode()
    assert redis_client(redis_url).dbsize() == 0


def test_a_failure_found_after_redis_is_killed_is_reported_with_its_example_and_kept_locally(
    redis_server: LoopbackRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = str(tmp_path)
    database = fuzz_database({SHARED_ENV: redis_server.url, LOCAL_ENV: local})
    seen: list[int] = []

    @settings(
        database=database,
        derandomize=False,
        max_examples=1_000,
        phases=[Phase.reuse, Phase.generate, Phase.shrink],
    )
    @given(st.integers(0, 1_000))
    def falls_over_past_9(n: int) -> None:
        if not seen:  # Hypothesis has read Redis (its reuse phase): now it dies
            redis_server.kill()
        seen.append(n)
        assert n < 10, "past 9"

    with pytest.raises(AssertionError, match="past 9") as raised:
        falls_over_past_9()
    assert "Failing test case: falls_over_past_9(\n    n=10,\n)" in raised.value.__notes__
    assert any(tmp_path.iterdir()), "the local database kept nothing"
    lost = capsys.readouterr().err.splitlines()
    assert len(lost) == 1, lost
    assert lost[0].startswith(f"fuzz: {redis_server.url}: connection lost at 0 s (")
    assert lost[0].endswith(f"); going on with the local database {local}")
