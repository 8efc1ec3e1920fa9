"""Real parts for the cluster fuzzing tests: a ``redis-server`` on a loopback port, and Ray
kept to loopback addresses.

Where the platform lacks one (no ``redis-server``, no ``ray`` or ``redis`` package) a test
skips with one line; under CI (``CI`` set) that is an error instead, since
``scripts/setup.sh`` installs them all.
"""

import importlib.util
import os
import shutil
from collections.abc import Iterator

import pytest

from harness.cluster.ray_run import LOOPBACK_ONLY
from harness.cluster.redis_server import LoopbackRedis, loopback_redis

# Ray reads this when first imported, which may be in any test of this process: set now.
os.environ.update(LOOPBACK_ONLY)


def require(present: bool, missing: str) -> None:
    """Skip (fail, under CI) with ``missing`` unless ``present``."""
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{missing}: CI installs it (scripts/setup.sh)")
    pytest.skip(missing)


@pytest.fixture
def redis_server() -> Iterator[LoopbackRedis]:
    """A fresh ``redis-server`` on 127.0.0.1, stopped after the test (or killed by it)."""
    require(shutil.which("redis-server") is not None, "no redis-server on this machine")
    require(importlib.util.find_spec("redis") is not None, "no redis package (the 'cluster' extra)")
    with loopback_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: LoopbackRedis) -> str:
    """The URL of ``redis_server``: database 0."""
    return redis_server.url


@pytest.fixture
def ray_installed() -> None:
    """Ray is installed (the 'cluster' extra)."""
    require(importlib.util.find_spec("ray") is not None, "no ray package (the 'cluster' extra)")
