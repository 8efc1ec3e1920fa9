"""A fuzzing run's tally, kept in Redis while it goes: what ``pagedkv fuzz --status`` reads
on any machine, and what the end-of-run summary prints.

A run is one ``pagedkv fuzz --ray`` command: its workers (Ray tasks, on any machines) add
the test cases and steps their pytest processes report, record the failures they find
with their shrunk steps, and keep a heartbeat; a worker whose heartbeat stops (its machine
gone, its process killed) is no longer counted alive, and the driver records it as dead
with Ray's reason. Keys (``pagedkv:fuzz:run:ID...``) expire ``KEEP_S`` after the run's
last write.
"""

import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis import Redis

RUNS = "pagedkv:fuzz:runs"  # sorted set: run id -> start time
HEARTBEAT_S = 15  # a worker silent this long is not counted alive (it beats every second)
KEEP_S = 8 * 24 * 3600  # as long as RedisExampleDatabase keeps an unused example


@dataclass(frozen=True)
class Failure:
    """A failure a worker found: the test, the worker and its pytest run (1, 2, ...) that
    found it, and Hypothesis' shrunk steps."""

    test: str
    worker: str
    run: int
    steps: str


@dataclass(frozen=True)
class RunTotals:
    """A run's numbers at one moment, summed over its workers."""

    run_id: str
    target: str
    workers: int
    seconds: int
    started: float  # time.time() at the start
    state: str  # running, finished or interrupted
    cases: int
    steps: int
    failures: int
    died: int
    alive: int

    def describe(self) -> str:
        """One line: ``run ID (TARGET, running): 2 of 2 workers alive, 0 died, 1,234 test
        cases, 98,765 steps, 0 failures, second 60 of 600``."""
        elapsed = min(int(time.time() - self.started), self.seconds)
        return (
            f"run {self.run_id} ({self.target}, {self.state}): {self.alive} of {self.workers} "
            f"workers alive, {self.died} died, {self.cases:,} test cases, {self.steps:,} "
            f"steps, {self.failures} failure{'s' * (self.failures != 1)}, second {elapsed} "
            f"of {self.seconds}"
        )


class RunTally:
    """The Redis keys of one run, and the operations its driver and workers make on them."""

    def __init__(self, redis: "Redis", run_id: str) -> None:
        self._redis = redis
        self.run_id = run_id
        self._key = f"pagedkv:fuzz:run:{run_id}"

    @classmethod
    def start(cls, redis: "Redis", target: str, workers: int, seconds: int) -> "RunTally":
        """A new run's tally, listed first by ``--status`` from now on."""
        now = time.time()
        run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(2)
        tally = cls(redis, run_id)
        meta = {"target": target, "workers": workers, "seconds": seconds, "started": now}
        pipe = redis.pipeline()
        pipe.hset(tally._key, mapping={**meta, "state": "running"})  # type: ignore[dict-item]
        pipe.zadd(RUNS, {run_id: now})
        pipe.execute()
        tally._keep()
        return tally

    def beat(self, worker: str) -> None:
        """``worker`` is alive (for the next ``HEARTBEAT_S`` seconds)."""
        pipe = self._redis.pipeline()
        pipe.sadd(f"{self._key}:workers", worker)
        pipe.set(f"{self._key}:alive:{worker}", 1, ex=HEARTBEAT_S)
        pipe.execute()

    def gone(self, worker: str) -> None:
        """``worker`` has stopped (at the deadline, on a failure, or interrupted)."""
        self._redis.delete(f"{self._key}:alive:{worker}")

    def add(self, cases: int, steps: int) -> None:
        """Count ``cases`` more test cases and ``steps`` more steps."""
        pipe = self._redis.pipeline()
        pipe.hincrby(self._key, "cases", cases)
        pipe.hincrby(self._key, "steps", steps)
        pipe.execute()

    def failed(self, failure: Failure) -> None:
        """Record a failure a worker found."""
        pipe = self._redis.pipeline()
        pipe.rpush(f"{self._key}:failures", json.dumps(asdict(failure)))
        pipe.hincrby(self._key, "failures", 1)
        pipe.execute()

    def died(self, worker: str) -> None:
        """Count ``worker`` as dead: it stopped before the deadline without a failure."""
        pipe = self._redis.pipeline()
        pipe.hincrby(self._key, "died", 1)
        pipe.delete(f"{self._key}:alive:{worker}")
        pipe.execute()

    def finish(self, state: str) -> None:
        """The run is over (``finished`` or ``interrupted``)."""
        self._redis.hset(self._key, "state", state)
        self._keep()

    def totals(self) -> RunTotals:
        """The run's numbers now."""
        fields = {_text(key): _text(value) for key, value in self._redis.hgetall(self._key).items()}
        workers = [_text(worker) for worker in self._redis.smembers(f"{self._key}:workers")]
        alive = sum(int(self._redis.exists(f"{self._key}:alive:{worker}")) for worker in workers)
        return RunTotals(
            run_id=self.run_id,
            target=fields.get("target", "?"),
            workers=int(fields.get("workers", 0)),
            seconds=int(fields.get("seconds", 0)),
            started=float(fields.get("started", 0)),
            state=fields.get("state", "?"),
            cases=int(fields.get("cases", 0)),
            steps=int(fields.get("steps", 0)),
            failures=int(fields.get("failures", 0)),
            died=int(fields.get("died", 0)),
            alive=alive,
        )

    def failures(self) -> list[Failure]:
        """The failures found so far, in the order they were recorded."""
        records = self._redis.lrange(f"{self._key}:failures", 0, -1)
        return [Failure(**json.loads(record)) for record in records]

    def _keep(self) -> None:
        pipe = self._redis.pipeline()
        for suffix in ("", ":workers", ":failures"):
            pipe.expire(self._key + suffix, KEEP_S)
        pipe.zremrangebyscore(RUNS, 0, time.time() - KEEP_S)
        pipe.execute()


def recent_runs(redis: "Redis", count: int) -> list[RunTally]:
    """The ``count`` runs started last, newest first."""
    run_ids: list[bytes] = redis.zrevrange(RUNS, 0, count - 1)  # type: ignore[assignment]
    return [RunTally(redis, _text(run_id)) for run_id in run_ids]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
