"""The example database a fuzzing run shares: Hypothesis' ``RedisExampleDatabase`` layered
under the local directory database, and the guard that keeps one Hypothesis version on it.

Every fuzz worker saves the failures it finds in both and replays from both, so a failure
found on one machine is replayed by the next run on any machine that points at the same
Redis, and the machine that found it keeps its own copy. Hypothesis' database format
changed in 6.124.0: the first user of a Redis database records its Hypothesis version
there, and a user on another version is refused before it runs anything.

``tests/conftest.py`` builds the ``fuzz`` profiles' databases here from the environment a
fuzz worker sets (``PAGEDKV_FUZZ_DATABASE``, ``PAGEDKV_FUZZ_LOCAL_DB``); the launchers
(``scripts/fuzz.sh``, ``pagedkv fuzz``, each Ray worker) call :func:`connect` first.
"""

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import hypothesis
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

if TYPE_CHECKING:
    from redis import Redis

LOCAL_DATABASE = ".hypothesis/fuzz-db"
SHARED_ENV = "PAGEDKV_FUZZ_DATABASE"  # redis://HOST:PORT/N
LOCAL_ENV = "PAGEDKV_FUZZ_LOCAL_DB"  # a directory; LOCAL_DATABASE when unset
VERSION_KEY = "pagedkv:fuzz:hypothesis-version"
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0
URL_SCHEMES = ("redis://", "rediss://", "unix://")


class SharedDatabaseError(ValueError):
    """A shared database that cannot be used: not a Redis URL, unreachable, or holding the
    examples of another Hypothesis version."""


def redis_client(url: str) -> "Redis":
    """A client of the Redis at ``url`` (``redis://HOST:PORT/N``); connects on first use."""
    from redis import Redis  # noqa: PLC0415  (the optional 'cluster' extra)

    if not url.startswith(URL_SCHEMES):
        raise SharedDatabaseError(f"the database must be a redis://HOST:PORT/N URL, got {url!r}")
    try:
        return Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S
        )
    except ValueError as error:
        raise SharedDatabaseError(f"bad Redis URL {url!r}: {error}") from None


def connect(url: str) -> "Redis":
    """A checked client of the Redis at ``url``: reachable, and holding examples of this
    Hypothesis version (the version is recorded there by the first caller)."""
    from redis.exceptions import RedisError  # noqa: PLC0415

    client = redis_client(url)
    ours = hypothesis.__version__
    try:
        client.set(VERSION_KEY, ours, nx=True)
        stored = client.get(VERSION_KEY)
    except RedisError as error:
        raise SharedDatabaseError(f"cannot reach Redis at {url}: {error}") from None
    theirs = stored.decode() if isinstance(stored, bytes) else str(stored)
    if theirs != ours:
        raise SharedDatabaseError(
            f"the database at {url} holds examples of Hypothesis {theirs}, this is "
            f"Hypothesis {ours}: run every worker on one version (the database format "
            "changed in 6.124.0), or use another database"
        )
    return client


def local_database(environ: Mapping[str, str]) -> str:
    """The local database's directory: ``PAGEDKV_FUZZ_LOCAL_DB``, else ``.hypothesis/fuzz-db``."""
    return environ.get(LOCAL_ENV) or LOCAL_DATABASE


def fuzz_database(environ: Mapping[str, str], read_only: bool = False) -> ExampleDatabase:
    """The ``fuzz`` profiles' database: the local directory, layered over Redis when the
    environment names a shared database (``read_only``: the replay reads Redis and never
    changes it, so replaying on a fixed branch does not delete the team's failures)."""
    local = DirectoryBasedExampleDatabase(local_database(environ))
    url = environ.get(SHARED_ENV)
    if not url:
        return local
    from hypothesis.extra.redis import RedisExampleDatabase  # noqa: PLC0415

    shared: ExampleDatabase = RedisExampleDatabase(redis_client(url))
    return MultiplexedDatabase(local, ReadOnlyDatabase(shared) if read_only else shared)


def main(argv: list[str]) -> int:
    """``python -m harness.cluster.shared_database URL``: check the database as every
    launcher does (``scripts/fuzz.sh --database``); one line and exit 2 when unusable."""
    try:
        connect(argv[0])
    except SharedDatabaseError as error:
        print(f"fuzz: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
