"""The example database a fuzzing run shares: Hypothesis' ``RedisExampleDatabase`` layered
under the local directory database, and the guard that keeps one Hypothesis version on it.

Every fuzz worker saves the failures it finds in both and replays from both, so a failure
found on one machine is replayed by the next run on any machine that points at the same
Redis, and the machine that found it keeps its own copy. Hypothesis' database format
changed in 6.124.0: the first user of a Redis database records its Hypothesis version
there, and a user on another version is refused before it runs anything.

Redis lost mid-run (stopped, unreachable) ends nothing: each pytest process goes on with its
local database alone (:class:`RedisWhileReachable`), and the launchers say so in one line
(:func:`watch` for ``scripts/fuzz.sh``, the Ray driver through its tally).

``tests/conftest.py`` builds the ``fuzz`` profiles' databases here from the environment a
fuzz worker sets (``PAGEDKV_FUZZ_DATABASE``, ``PAGEDKV_FUZZ_LOCAL_DB``); the launchers
(``scripts/fuzz.sh``, ``pagedkv fuzz``, each Ray worker) call :func:`connect` first.
"""

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import hypothesis
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

if TYPE_CHECKING:
    from redis import Redis

T = TypeVar("T")

LOCAL_DATABASE = ".hypothesis/fuzz-db"
SHARED_ENV = "PAGEDKV_FUZZ_DATABASE"  # redis://HOST:PORT/N
LOCAL_ENV = "PAGEDKV_FUZZ_LOCAL_DB"  # a directory; LOCAL_DATABASE when unset
VERSION_KEY = "pagedkv:fuzz:hypothesis-version"
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0
URL_SCHEMES = ("redis://", "rediss://", "unix://")


WATCH_EVERY_S = 1.0


class SharedDatabaseError(ValueError):
    """A shared database that cannot be used: not a Redis URL, unreachable, or holding the
    examples of another Hypothesis version."""


class UnreachableDatabaseError(SharedDatabaseError):
    """A Redis that does not answer (a worker that starts after it was lost goes on without)."""


def redis_client(url: str) -> "Redis":
    """A client of the Redis at ``url`` (``redis://HOST:PORT/N``); connects on first use."""
    from redis import Redis  # noqa: PLC0415  (the optional 'cluster' extra)

    if not url.startswith(URL_SCHEMES):
        raise SharedDatabaseError(f"the database must be a redis://HOST:PORT/N URL, got {url!r}")
    # redis-py reads the N of /N as a number, or as 0 when it is not one (/x, silently).
    number = urlsplit(url).path.strip("/") if url.startswith(URL_SCHEMES[:2]) else ""
    if not number.isdigit() and number != "":
        raise SharedDatabaseError(
            f"the database number in {url!r} must be an integer >= 0 (redis://HOST:PORT/N), "
            f"got {number!r}"
        )
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
        raise UnreachableDatabaseError(f"cannot reach Redis at {url}: {error}") from None
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
    shared: ExampleDatabase = RedisWhileReachable(url, local_database(environ))
    return MultiplexedDatabase(local, ReadOnlyDatabase(shared) if read_only else shared)


class RedisWhileReachable(ExampleDatabase):
    """Hypothesis' ``RedisExampleDatabase`` until a call to Redis fails; from then on, for
    the rest of the process, empty and keeping nothing, so that the local database it is
    layered under (``fuzz_database``) carries on alone. The loss is one line on stderr.

    Without it a lost Redis ended a pytest process with redis' ``ConnectionError``, and a
    failure found then was reported as that error instead of its falsifying example."""

    def __init__(self, url: str, local: str) -> None:
        from hypothesis.extra.redis import RedisExampleDatabase  # noqa: PLC0415

        super().__init__()
        self._url = url
        self._local = local
        self._redis: ExampleDatabase | None = RedisExampleDatabase(redis_client(url))
        self._started = time.monotonic()

    def __repr__(self) -> str:
        return f"RedisWhileReachable({self._url!r})"

    def fetch(self, key: bytes) -> Iterable[bytes]:
        # Read whole before yielding: a connection lost half-way yields nothing from Redis.
        values = self._call(lambda redis: list(redis.fetch(key)))
        yield from values or []

    def save(self, key: bytes, value: bytes) -> None:
        self._call(lambda redis: redis.save(key, value))

    def delete(self, key: bytes, value: bytes) -> None:
        self._call(lambda redis: redis.delete(key, value))

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._call(lambda redis: redis.move(src, dest, value))

    def _call(self, call: Callable[[ExampleDatabase], T]) -> T | None:
        from redis.exceptions import RedisError  # noqa: PLC0415

        if self._redis is None:
            return None
        try:
            return call(self._redis)
        except (RedisError, OSError) as error:
            self._redis = None
            seconds = int(time.monotonic() - self._started)
            print(f"fuzz: {lost_line(self._url, seconds, error, self._local)}", file=sys.stderr)
            return None


def lost_line(url: str, seconds: int, error: object, local: str) -> str:
    """What every launcher says when Redis stops answering ``seconds`` into a run."""
    return (
        f"{url}: connection lost at {seconds} s ({error}); going on with the local database {local}"
    )


def watch(url: str, started: float) -> str:
    """Ask the Redis at ``url`` every ``WATCH_EVERY_S`` whether it answers, until it does not
    (the line saying so, timed from ``started``, a ``time.time()``) or this process's
    parent has gone (``""``)."""
    from redis.exceptions import RedisError  # noqa: PLC0415

    client = redis_client(url)
    parent = os.getppid()
    while os.getppid() == parent:  # an orphaned watcher stops by itself
        try:
            client.ping()
        except (RedisError, OSError) as error:
            seconds = int(time.time() - started)
            return lost_line(url, seconds, error, local_database(os.environ))
        time.sleep(WATCH_EVERY_S)
    return ""


def main(argv: list[str]) -> int:
    """``python -m harness.cluster.shared_database URL``: check the database as every
    launcher does (``scripts/fuzz.sh --database``); one line and exit 2 when unusable.
    ``... --watch URL STARTED``: ``scripts/fuzz.sh``'s watcher, one line if Redis is lost
    (STARTED: the run's start, in seconds since the epoch)."""
    if argv[:1] == ["--watch"]:
        try:
            if lost := watch(argv[1], float(argv[2])):
                print(f"fuzz: {lost}", file=sys.stderr)
        except KeyboardInterrupt:  # Ctrl-C at a terminal reaches the script's whole group
            return 130
        return 0
    try:
        connect(argv[0])
    except SharedDatabaseError as error:
        print(f"fuzz: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
