"""A throwaway ``redis-server`` on a loopback port, for trying the cluster commands on one
machine: the tests and the overhead benchmark start one, and stop it when done.

It listens on 127.0.0.1 only, keeps nothing on disk (no snapshots, no append-only file)
and is started as a child of this process, so nothing outlives the ``with`` block.
"""

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """No ``redis-server`` to start, or one that did not answer."""


@dataclass(frozen=True)
class LoopbackRedis:
    """A running ``redis-server``: its URL (``redis://127.0.0.1:P/0``) and its process."""

    url: str
    process: "subprocess.Popen[bytes]"

    def kill(self) -> None:
        """Kill it (SIGKILL), as a crash or the OOM killer would; returns once it is gone."""
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def loopback_redis() -> Iterator[LoopbackRedis]:
    """Start ``redis-server`` on a free loopback port, stopped when the block ends."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError("no redis-server on PATH (Debian: apt-get install redis-server)")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pagedkv-redis-") as directory:
        log = f"{directory}/redis.log"
        options = ["--bind", "127.0.0.1", "--port", str(port), "--dir", directory]
        server = subprocess.Popen(
            [binary, *options, "--save", "", "--appendonly", "no", "--logfile", log],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(port, server, log)
            yield LoopbackRedis(f"redis://127.0.0.1:{port}/0", server)
        finally:
            server.terminate()
            try:
                server.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for(port: int, server: "subprocess.Popen[bytes]", log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            try:
                with open(log, encoding="utf-8", errors="replace") as lines:
                    last = (lines.read().strip().splitlines() or ["no log"])[-1]
            except OSError:
                last = "no log"
            raise RedisServerError(f"redis-server exited with {server.returncode}: {last}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                if connection.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RedisServerError(f"redis-server did not answer on port {port} in {START_TIMEOUT_S} s")
