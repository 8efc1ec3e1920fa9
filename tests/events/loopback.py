"""What the event tests run on loopback: free port pairs, and NVIDIA Dynamo's KV indexer as
a process of ``.venv-dynamo`` (``scripts/setup.sh`` installs ``ai-dynamo-runtime`` there)."""

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pytest
import zmq

from harness.kv_publisher import ZmqEventPublisher
from harness.kv_wire import WireEncoder

DYNAMO_PYTHON = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"
T = TypeVar("T")


def require_dynamo() -> Path:
    """``.venv-dynamo``'s interpreter, or a one-line skip when it is absent."""
    if not DYNAMO_PYTHON.exists():
        pytest.skip("Dynamo's indexer is absent: scripts/setup.sh installs it in .venv-dynamo")
    return DYNAMO_PYTHON


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A loopback port whose successor is free too (a PUB socket and its replay); ``host``
    ``"::1"`` for IPv6."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50):
        with socket.socket(family) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        with socket.socket(family) as next_one:
            try:
                next_one.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free loopback ports")


class Wire(NamedTuple):
    """A publisher bound on loopback and a subscriber it waited for."""

    publisher: ZmqEventPublisher
    subscriber: "zmq.Socket[bytes]"
    port: int


class SlowWire(ZmqEventPublisher):
    """A publisher whose wire takes 20 ms a batch."""

    def send(self, seq: int, payload: bytes) -> None:
        time.sleep(0.02)
        super().send(seq, payload)


@contextmanager
def open_wire(publisher_class: type[ZmqEventPublisher] = ZmqEventPublisher) -> Iterator[Wire]:
    """A ``publisher_class`` at a free loopback port pair, encoding for blocks of 4 tokens
    in a full-attention and an 8-token-window group, once a subscriber subscribed; closed
    after."""
    port = free_port_pair()
    subscriber: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    publisher = publisher_class(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{port + 1}",
        WireEncoder(4, (None, 8), "vllm"),
        subscriber_wait_s=5,
    )
    assert publisher.subscribed
    try:
        yield Wire(publisher, subscriber, port)
    finally:
        publisher.close()
        subscriber.close(linger=0)


def receive(sock: "zmq.Socket[bytes]", count: int) -> list[list[bytes]]:
    """The next ``count`` messages on ``sock``; ``AssertionError`` if one takes 5 s."""
    frames: list[list[bytes]] = []
    for _ in range(count):
        assert sock.poll(5000), f"nothing arrived within 5 s after {len(frames)} of {count}"
        frames.append(sock.recv_multipart())
    return frames


class Indexer:
    """``python -m dynamo.indexer`` serving HTTP on a loopback port."""

    def __init__(self, block_size: int, log: Path) -> None:
        self.block_size = block_size
        self.port = free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [
                str(require_dynamo()),
                "-m",
                "dynamo.indexer",
                "--block-size",
                str(block_size),
                "--port",
                str(self.port),
                "--threads",
                "1",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self.get("/health"), lambda _: True, "the indexer to answer /health")

    def get(self, path: str) -> Any:  # Any: the indexer's JSON
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return json.loads(response.read() or b"null")

    def post(self, path: str, body: dict[str, object]) -> Any:  # Any: the indexer's JSON
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read() or b"null")

    def register(self, worker: int, port: int) -> None:
        """Subscribe to a publisher at ``port`` (replay at ``port + 1``) as ``worker``."""
        self.post(
            "/register",
            {
                "instance_id": worker,
                "endpoint": f"tcp://127.0.0.1:{port}",
                "replay_endpoint": f"tcp://127.0.0.1:{port + 1}",
                "model_name": "default",
                "block_size": self.block_size,
            },
        )

    def device_hashes(self) -> set[int]:
        """Every block hash the indexer holds on the device tier (``/dump``)."""
        return {
            block["block_hash"]
            for tree in self.get("/dump").values()
            for entry in tree["events"]
            if entry["storage_tier"] == "device"
            for block in entry["event"]["data"]["stored"]["blocks"]
        }

    def score(self, token_ids: list[int], worker: int) -> int:
        """``/query``'s score of ``worker`` for a prompt, in tokens (0: no match)."""
        scores = self.post("/query", {"token_ids": token_ids, "model_name": "default"})["scores"]
        return int(scores.get(str(worker), {}).get("0", 0))

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._log.close()


def wait_for(read: Callable[[], T], done: Callable[[T], bool], what: str, timeout: float = 10) -> T:
    """Poll ``read`` until ``done`` holds of its value; ``AssertionError`` naming ``what``
    and the last value after ``timeout`` seconds (the indexer applies events in its own
    time)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = read()
        except OSError:
            if time.monotonic() > deadline:
                raise
        else:
            if done(value) or time.monotonic() > deadline:
                assert done(value), f"gave up waiting for {what}: last {value!r}"
                return value
        time.sleep(0.05)
