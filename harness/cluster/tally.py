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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

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


class TallyLostError(RuntimeError):
    """Redis stopped answering: the run's tally there is out of reach from now on."""


class RunTally:
    """The Redis keys of one run, and the operations its driver and workers make on them.

    Losing Redis ends nothing: the first call that fails records why in ``lost``, and from
    then on every write does nothing and every read raises ``TallyLostError`` (each worker
    still counts its own cases and steps, and reports them to the driver at its end)."""

    def __init__(self, redis: "Redis", run_id: str) -> None:
        self._redis = redis
        self.run_id = run_id
        self._key = f"pagedkv:fuzz:run:{run_id}"
        self.lost: str | None = None  # redis' error, once a call has failed

    @classmethod
    def start(cls, redis: "Redis", target: str, workers: int, seconds: int) -> "RunTally":
        """A new run's tally, listed first by ``--status`` from now on (``TallyLostError``
        if Redis does not answer)."""
        now = time.time()
        run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(2)
        tally = cls(redis, run_id)
        meta = {"target": target, "workers": workers, "seconds": seconds, "started": now}
        pipe = redis.pipeline()
        pipe.hset(tally._key, mapping={**meta, "state": "running"})  # type: ignore[dict-item]
        pipe.zadd(RUNS, {run_id: now})
        tally._keep(pipe)
        tally._read(pipe)
        return tally

    def answers(self) -> bool:
        """Whether Redis answers (a PING); once it has not, it never does again."""
        pipe = self._redis.pipeline()
        pipe.ping()
        return self._write(pipe) is not None

    def beat(self, worker: str) -> None:
        """``worker`` is alive (for the next ``HEARTBEAT_S`` seconds)."""
        pipe = self._redis.pipeline()
        pipe.sadd(f"{self._key}:workers", worker)
        pipe.set(f"{self._key}:alive:{worker}", 1, ex=HEARTBEAT_S)
        self._write(pipe)

    def gone(self, worker: str) -> None:
        """``worker`` has stopped (at the deadline, on a failure, or interrupted)."""
        pipe = self._redis.pipeline()
        pipe.delete(f"{self._key}:alive:{worker}")
        self._write(pipe)

    def add(self, cases: int, steps: int) -> None:
        """Count ``cases`` more test cases and ``steps`` more steps."""
        pipe = self._redis.pipeline()
        pipe.hincrby(self._key, "cases", cases)
        pipe.hincrby(self._key, "steps", steps)
        self._write(pipe)

    def failed(self, failure: Failure) -> None:
        """Record a failure a worker found."""
        pipe = self._redis.pipeline()
        pipe.rpush(f"{self._key}:failures", json.dumps(asdict(failure)))
        pipe.hincrby(self._key, "failures", 1)
        self._write(pipe)

    def died(self, worker: str) -> None:
        """Count ``worker`` as dead: it stopped before the deadline without a failure."""
        pipe = self._redis.pipeline()
        pipe.hincrby(self._key, "died", 1)
        pipe.delete(f"{self._key}:alive:{worker}")
        self._write(pipe)

    def finish(self, state: str) -> None:
        """The run is over (``finished`` or ``interrupted``)."""
        pipe = self._redis.pipeline()
        pipe.hset(self._key, "state", state)
        self._keep(pipe)
        self._write(pipe)

    def totals(self) -> RunTotals:
        """The run's numbers now."""
        pipe = self._redis.pipeline()
        pipe.hgetall(self._key)
        pipe.smembers(f"{self._key}:workers")
        stored, members = self._read(pipe)
        workers = sorted(_text(worker) for worker in members)
        pipe = self._redis.pipeline()
        for worker in workers:
            pipe.exists(f"{self._key}:alive:{worker}")
        alive = sum(self._read(pipe)) if workers else 0
        fields = {_text(key): _text(value) for key, value in stored.items()}
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
        pipe = self._redis.pipeline()
        pipe.lrange(f"{self._key}:failures", 0, -1)
        (records,) = self._read(pipe)
        return [Failure(**json.loads(record)) for record in records]

    def _keep(self, pipe: "Pipeline") -> None:
        for suffix in ("", ":workers", ":failures"):
            pipe.expire(self._key + suffix, KEEP_S)
        pipe.zremrangebyscore(RUNS, 0, time.time() - KEEP_S)

    def _write(self, pipe: "Pipeline") -> list[Any] | None:
        """Run ``pipe``'s commands; None once Redis is lost (``lost`` says why)."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        if self.lost is not None:
            return None
        try:
            return pipe.execute()
        except (RedisError, OSError) as error:
            self.lost = str(error) or type(error).__name__
            return None

    def _read(self, pipe: "Pipeline") -> list[Any]:
        if (replies := self._write(pipe)) is None:
            raise TallyLostError(f"Redis stopped answering: {self.lost}")
        return replies


def recent_runs(redis: "Redis", count: int) -> list[RunTally]:
    """The ``count`` runs started last, newest first."""
    run_ids: list[bytes] = redis.zrevrange(RUNS, 0, count - 1)  # type: ignore[assignment]
    return [RunTally(redis, _text(run_id)) for run_id in run_ids]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
