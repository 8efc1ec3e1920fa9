"""The processes a test started, found in ``/proc`` by the session it started them in.

A test that checks nothing is left running after a Ctrl-C watches only these: it starts
its command with ``start_new_session=True`` (and records the sessions that command opens
in turn), never every process of the checkout, which another run in the same checkout
would share.
"""

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

WAIT_S = 0.2


@dataclass(frozen=True)
class ProcessInfo:
    """One process, from ``/proc/PID/stat`` and ``cmdline``."""

    pid: int
    parent: int
    session: int
    command: str


def processes() -> list[ProcessInfo]:
    """Every process that has not exited (a zombie, waiting to be reaped, has)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The command name in (...) may hold spaces: the fields follow its last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found.append(ProcessInfo(int(entry.name), int(fields[1]), int(fields[3]), command))
    return found


def in_sessions(sessions: set[int]) -> list[ProcessInfo]:
    """The live processes of ``sessions``."""
    return [process for process in processes() if process.session in sessions]


def left_after(sessions: set[int], timeout_s: float) -> list[ProcessInfo]:
    """The processes of ``sessions`` still alive ``timeout_s`` from now, or none as soon
    as all have gone."""
    deadline = time.monotonic() + timeout_s
    while (left := in_sessions(sessions)) and time.monotonic() < deadline:
        time.sleep(WAIT_S)
    return left


def child_session(parent: int, timeout_s: float) -> int:
    """The session a child of ``parent`` opened (``start_new_session``), waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes():
            if process.parent == parent and process.session == process.pid:
                return process.session
        time.sleep(WAIT_S)
    raise AssertionError(f"process {parent} started no session in {timeout_s} s")


def wait_for_command(sessions: set[int], part: str, timeout_s: float) -> None:
    """Wait until a process of ``sessions`` runs a command holding ``part``."""
    deadline = time.monotonic() + timeout_s
    while not any(part in process.command for process in in_sessions(sessions)):
        assert time.monotonic() < deadline, f"no {part!r} started in {timeout_s} s"
        time.sleep(WAIT_S)


@contextlib.contextmanager
def own_session(
    argv: Sequence[str], environment: Mapping[str, str]
) -> Iterator["subprocess.Popen[str]"]:
    """``argv`` started in a session (and process group) of its own, stderr piped; its
    group killed if it still runs when the block ends (the test failed half-way)."""
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, env=environment, start_new_session=True
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ctrl_c(process: "subprocess.Popen[str]", timeout_s: float) -> str:
    """SIGINT to ``process``'s group, as a terminal's Ctrl-C; its stderr once it has ended."""
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=timeout_s)
    return err
