"""A corpus shared across machines through Redis: what one fuzz worker finds, another replays.

Fuzz workers read and write a ``RedisExampleDatabase``; a developer's machine reads it
through ``MultiplexedDatabase(local, ReadOnlyDatabase(redis))``, so it replays every case
the fleet found without ever writing to the shared corpus. The server is Debian's
``redis-server``, started here on a free loopback port and stopped after the test.
"""

import shutil
import socket
import subprocess
import time
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)
from hypothesis.stateful import run_state_machine_as_test

from tests.lockstep import machine_for
from tests.planted_bugs import LeaksOneBlockOnRelease

# Any: the redis client is imported only where it is installed (a dev dependency).
redis: Any = pytest.importorskip("redis", reason="the redis client is not installed")
hypothesis_redis: Any = pytest.importorskip("hypothesis.extra.redis")

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not on PATH (Debian: apt-get install redis-server)",
)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def redis_client(tmp_path: Path) -> Iterator[Any]:
    """A client of a fresh, empty redis-server on loopback, with no persistence."""
    assert REDIS_SERVER is not None
    port = free_loopback_port()
    # No snapshots, no append-only file: the corpus lives only as long as the test.
    no_persistence = ["--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    server = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", *no_persistence],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail(f"redis-server did not answer on port {port} within 5 s")
        yield client
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def corpus(client: Any) -> dict[bytes, set[bytes]]:
    """Everything the shared database holds: each key with its members."""
    return {key: set(client.smembers(key)) for key in client.keys("*")}


def test_a_bug_one_worker_saves_to_redis_replays_on_a_machine_with_an_empty_database(
    redis_client: Any, tmp_path: Path
) -> None:
    leaky = machine_for(LeaksOneBlockOnRelease)
    shared = hypothesis_redis.RedisExampleDatabase(redis_client)

    # Worker A: a fuzz worker writing to the shared corpus finds the planted leak.
    worker_a = settings(
        database=shared,
        max_examples=300,
        deadline=None,
        phases=[Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        print_blob=False,
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(leaky, settings=worker_a)
    saved = corpus(redis_client)
    assert saved, "worker A saved nothing to Redis"

    # Worker B: empty local database, Redis read-only, and no generation at all: a failure
    # on its first run can only be the case that worker A saved.
    local_path = tmp_path / "developer-db"
    developer = MultiplexedDatabase(
        DirectoryBasedExampleDatabase(local_path), ReadOnlyDatabase(shared)
    )
    replay_only = settings(
        database=developer,
        deadline=None,
        phases=[Phase.reuse],
        report_multiple_bugs=False,
        print_blob=False,
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(leaky, settings=replay_only)
    assert corpus(redis_client) == saved, "the developer machine wrote to the shared corpus"
    assert any(local_path.rglob("*")), "the replayed case was not kept locally"


def test_a_replay_only_run_with_nothing_saved_runs_no_case(tmp_path: Path) -> None:
    # The control for the test above: reuse alone, over an empty database, runs nothing,
    # so it cannot find the planted leak by itself.
    empty = DirectoryBasedExampleDatabase(tmp_path / "empty-db")
    replay_only = settings(database=empty, deadline=None, phases=[Phase.reuse])
    with pytest.raises(unittest.SkipTest, match="run no test cases"):
        run_state_machine_as_test(machine_for(LeaksOneBlockOnRelease), settings=replay_only)
