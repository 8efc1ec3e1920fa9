"""A fuzzing run's workers as Ray tasks: connect to a cluster (or start a local one), submit
one task per worker, follow them until they end, and stop them all on Ctrl-C.

Each task runs ``harness.cluster.worker.fuzz_worker`` and needs one CPU; Ray places them
on whichever nodes have one. A task that dies (its process killed, its node lost) comes
back as Ray's error, and is counted dead in the run's tally with Ray's reason; Ray never
retries it (``max_retries=0``): a death is reported, not hidden by a retry.
"""

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from harness.cluster.tally import RunTally
from harness.cluster.worker import STOP_S, FuzzJob, WorkerReport, fuzz_worker

if TYPE_CHECKING:
    from ray import ObjectRef

WAIT_S = 1.0  # how often the driver looks at its tasks (and redraws the progress)
CONNECT_TIMEOUT_S = 3.0
ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own: the cluster ray.init() joins when given no address
# Ray's own switch for a single-machine cluster (its default on macOS and Windows): every
# Ray process binds and connects to 127.0.0.1 instead of the machine's network address.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class ClusterError(ValueError):
    """A Ray cluster that cannot be used: an unreachable address, or a Ray that refuses."""


def start_local_cluster(num_cpus: int) -> None:
    """Start a Ray cluster of ``num_cpus`` CPUs on this machine, on loopback addresses only.

    Ray reads the loopback switch when it is first imported: in a process that imported
    it before, set it in the environment first. Ctrl-C is held until Ray has started, then
    Ray is stopped and the interrupt raised: interrupted half-way, ``ray.init`` left the
    raylet's two agents (started before it could record them) running for a minute."""
    os.environ.update(LOOPBACK_ONLY)
    import ray  # noqa: PLC0415  (the optional 'cluster' extra)

    with _interrupts_held() as held:
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
        except (ConnectionError, RuntimeError, ValueError) as error:
            if not held:
                raise ClusterError(f"cannot start a local Ray cluster: {error}") from None
        if held:
            ray.shutdown()
    if held:
        raise KeyboardInterrupt


def connect(address: str | None, workers: int) -> None:
    """Connect this process to Ray (a process already connected stays as it is).

    ``None`` joins the cluster ``RAY_ADDRESS`` names, as ``ray.init()`` would, or else
    starts a local cluster of ``workers`` CPUs; ``auto`` joins ``RAY_ADDRESS`` or the
    cluster this machine is part of; ``ray://HOST:PORT`` (Ray Client) or ``HOST:PORT`` (the
    head's GCS) joins a remote one. An address is checked to answer first (Ray itself
    would retry for minutes)."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return
    source = "--ray"
    environment = os.environ.get(ADDRESS_ENV, "")
    if address in (None, "auto") and environment not in ("", "local"):
        address, source = environment, ADDRESS_ENV  # what Ray would join anyway
    if address is None:
        start_local_cluster(workers)
        return
    named = address if source == "--ray" else f"{address} ({source})"
    if address != "auto":
        _check_reachable(address, source, named)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ClusterError(f"cannot join the Ray cluster at {named}: {error}") from None


def run_workers(
    job: FuzzJob, workers: int, tally: RunTally, follow: Callable[[list[WorkerReport]], None]
) -> list[WorkerReport]:
    """Run ``workers`` tasks of ``job`` to their end, handing ``follow`` every second the
    reports of the workers that ended since; on Ctrl-C, stop every task (each stops its
    pytest) before the interrupt goes on."""
    import ray  # noqa: PLC0415

    task = ray.remote(num_cpus=1, max_retries=0)(fuzz_worker)
    names = {task.remote(job, index): f"w{index}" for index in range(1, workers + 1)}
    pending = list(names)
    reports: list[WorkerReport] = []
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S)
            ended = [_report(ref, names[ref], tally) for ref in done]
            reports += ended
            follow(ended)
    except KeyboardInterrupt:
        _stop(pending)
        raise
    return sorted(reports, key=lambda report: int(report.worker[1:]))


def available_cpus() -> int:
    """The CPUs of the connected cluster (its nodes now; an autoscaler may add more)."""
    import ray  # noqa: PLC0415

    return int(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]


def disconnect() -> None:
    """Leave Ray (which stops the local cluster, when this process started one); Ctrl-C
    meanwhile is ignored, so that the stop is not cut short."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        with _interrupts_held():
            ray.shutdown()


def _report(ref: "ObjectRef[WorkerReport]", worker: str, tally: RunTally) -> WorkerReport:
    import ray  # noqa: PLC0415
    from ray.exceptions import RayError, RayTaskError  # noqa: PLC0415

    try:
        report: WorkerReport = ray.get(ref)
        return report
    except RayTaskError as error:  # the worker raised: a refusal (another Hypothesis...)
        reason = str(error.cause).splitlines()[-1] if error.cause else type(error).__name__
    except RayError as error:  # the worker's process or node died
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    tally.died(worker)
    return WorkerReport(worker, 0, 0, 0, died=reason)


def _stop(pending: "list[ObjectRef[WorkerReport]]") -> None:
    """Interrupt each task (Ray raises KeyboardInterrupt in it: it stops its pytest and
    leaves the tally), then kill those still running ``STOP_S`` later."""
    import ray  # noqa: PLC0415

    for ref in pending:
        ray.cancel(ref)
    deadline = time.monotonic() + 2 * STOP_S
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S)
    for ref in pending:
        ray.cancel(ref, force=True)


def _check_reachable(address: str, source: str, named: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"{source} takes auto, ray://HOST:PORT or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise ClusterError(f"cannot reach the Ray cluster at {named}: {error}") from None


@contextlib.contextmanager
def _interrupts_held() -> Iterator[list[int]]:
    """SIGINT recorded in the yielded list instead of raised, until the block ends (in the
    main thread, where Python handles signals; elsewhere nothing changes)."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
