"""What the event tests run on loopback: free port pairs, and NVIDIA Dynamo's KV indexer as
a process of ``.venv-dynamo`` (``scripts/setup.sh`` installs ``ai-dynamo-runtime`` there)."""

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

DYNAMO_PYTHON = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"
T = TypeVar("T")


def require_dynamo() -> Path:
    """``.venv-dynamo``'s interpreter, or a one-line skip when it is absent."""
    if not DYNAMO_PYTHON.exists():
        pytest.skip("Dynamo's indexer is absent: scripts/setup.sh installs it in .venv-dynamo")
    return DYNAMO_PYTHON


def free_port_pair() -> int:
    """A loopback port whose successor is free too (a PUB socket and its replay)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as next_one:
            try:
                next_one.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free loopback ports")


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
