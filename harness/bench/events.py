"""``python -m harness.bench.events`` (``pagedkv bench events``): KV event batches a second
through pagedkv's ``ZmqEventPublisher`` and through vLLM 0.33's own
(``vllm.distributed.kv_events.ZmqEventPublisher``, with its replay socket, built as vLLM's
``EventPublisherFactory`` builds it), the same batches, every one received by a ZeroMQ
subscriber in a process of its own.

Two sets of ``--batches`` batches: empty ones, and the ones impl's ``EventPublisher`` makes
of a fixed-seed prefix-heavy trace (``harness.bench.host_prefix``'s: shared system
prompts) replayed through the allocator, one batch per admission (its events and those of
the appends and releases before it: stores and evictions' removes), repeated from the
start if the trace gives fewer. A device pool only, as vLLM's ``BlockPool`` makes its
batches (vLLM's host-side events come from its offloading connector, apart).

Ours is handed the spec's events and builds vLLM's wire structs from them in its thread.
vLLM's publisher takes its own ``KVEventBatch``, which its block pool and scheduler build
during the step; it runs twice: handed the batches ready made (our payloads decoded with
vLLM's classes, before the clock starts), and building each from the same events as
vLLM's block pool does, before its ``publish``. A round: the subscriber is told how many
batches to expect from which publisher, the clock starts, every batch is published, and
the clock stops when the subscriber says the last arrived, none missing, all in order.
After a warm-up round of each, the three take turns (the order alternating) for
``--repeats`` rounds; batches/s is the median. Needs vLLM (the 'conformance' extra).
"""

import argparse
import gc
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from harness.bench.host_prefix import shared_prefix_trace
from harness.bench.prefix import replay_prompts
from harness.kv_publisher import ZmqEventPublisher
from harness.kv_wire import WireEncoder
from harness.parsing import OneLineParser, fail, int_in, run_interruptible
from impl import AppendedSlots, KVCacheManager
from impl.event_publisher import EventPublisher
from spec.event_stream import EventBatch, KeyRemoved, KeyStored, StreamEvent

PROG = "python -m harness.bench.events"
BLOCK_SIZE = 16
# pagedkv's publisher is handed the spec's events and builds the wire structs in its thread;
# vLLM's, its own structs, which its block pool built as the step went: handed them ready
# made, and building them from the same events before each publish.
METHODS = ("pagedkv", "vLLM 0.33 (ready made)", "vLLM 0.33 (building)")
# The most a batch may take to reach the subscriber before a round counts as lost.
RECEIVE_TIMEOUT_MS = 10_000

Events = tuple[StreamEvent, ...]


class BatchPerAdmission(KVCacheManager):
    """A manager whose events become one batch per admission: its own and those of the
    appends and releases since the one before."""

    def __init__(self, total_blocks: int) -> None:
        self.stream = EventPublisher(BLOCK_SIZE)
        self.batches: list[Events] = []
        super().__init__(total_blocks, BLOCK_SIZE, event_sink=self.stream.record)

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        slots = super().allocate(request_id, tokens, cache_salt)
        self.batches.extend(batch.events for batch in self.stream.end_step())
        return slots


def trace_batches(count: int, requests: int, seed: int) -> list[Events]:
    """``count`` batches of a ``requests``-request trace through a pool of 2,048 blocks,
    repeated from the start if it gives fewer."""
    trace = shared_prefix_trace(requests, systems=32, system_tokens=512, seed=seed)
    manager = BatchPerAdmission(total_blocks=2_048)
    replay_prompts(trace, manager, max_running=64, seed=seed)
    return [manager.batches[i % len(manager.batches)] for i in range(count)]


def subscribe(endpoints: dict[str, str], conn: Connection) -> None:
    """The subscriber process: a SUB socket per publisher. For each ``(name, count)`` it
    is sent, it receives ``count`` batches from ``name`` and answers with how many arrived
    in order (``count`` or fewer: one late by ``RECEIVE_TIMEOUT_MS`` ends the round); for
    ``(name, 0)``, how many arrived within 100 ms (the connection check)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = {}
    for name, endpoint in endpoints.items():
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)  # no limit: a round's batches wait here, none dropped
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        sockets[name] = sock
    conn.send("connected")
    while (request := conn.recv()) is not None:
        name, count = request
        sock = sockets[name]
        if count == 0:
            drained = 0
            while sock.poll(100):
                sock.recv_multipart()
                drained += 1
            conn.send(drained)
            continue
        in_order, last = 0, None
        while in_order < count and sock.poll(RECEIVE_TIMEOUT_MS):
            seq = int.from_bytes(sock.recv_multipart()[1], "big")
            if last is not None and seq != last + 1:
                break
            in_order, last = in_order + 1, seq
        conn.send(in_order)
    context.destroy(linger=0)


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports free now (bound together, so all different)."""
    probes = [socket.socket() for _ in range(count)]
    for probe in probes:
        probe.bind(("127.0.0.1", 0))
    ports = [int(probe.getsockname()[1]) for probe in probes]
    for probe in probes:
        probe.close()
    return ports


class VllmBatches:
    """Our batches as vLLM's own ``KVEventBatch``: built from the spec's events as vLLM's
    block pool and scheduler build theirs (``BlockStored`` per block, by keyword), or
    decoded from our payload (the same batch, with nothing of building it)."""

    def __init__(self, encoder: WireEncoder) -> None:
        from vllm.distributed import kv_events  # noqa: PLC0415  (the 'conformance' extra)

        self.kv_events = kv_events
        self.encoder = encoder
        self._decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode

    def decoded(self, events: Events) -> Any:  # Any: vLLM's KVEventBatch
        """The batch, ready made: our payload decoded with vLLM's classes."""
        return self._decode(self.encoder.encode(EventBatch(0, events), time.time()))

    def built(self, events: Events) -> Any:  # Any: vLLM's KVEventBatch
        """The batch as vLLM's scheduler makes one: each event a struct of its own."""
        kv = self.kv_events
        wire: list[Any] = []
        for event in events:
            if isinstance(event, KeyStored):
                salt = event.cache_salt
                wire.append(
                    kv.BlockStored(
                        block_hashes=[event.block_hash],
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=BLOCK_SIZE,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        extra_keys=[None if salt is None else (salt,)],
                        group_idx=event.group,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            elif isinstance(event, KeyRemoved):
                wire.append(kv.BlockRemoved([event.block_hash], event.medium, event.group))
            else:
                wire.append(kv.AllBlocksCleared())
        return kv.KVEventBatch(ts=time.time(), events=wire)


class Bench:
    """Both publishers bound on loopback and the subscriber process connected to both;
    each method: what it is handed (made before the clock starts) and its ``publish``."""

    def __init__(self) -> None:
        from vllm.distributed import kv_events  # noqa: PLC0415  (the 'conformance' extra)

        ours, ours_replay, theirs, theirs_replay = free_ports(4)
        self.encoder = WireEncoder(BLOCK_SIZE, (None,), "vllm")
        vllm = VllmBatches(self.encoder)
        spawn = multiprocessing.get_context("spawn")
        self.conn, child = spawn.Pipe()
        endpoints = {"pagedkv": f"tcp://127.0.0.1:{ours}", "vllm": f"tcp://127.0.0.1:{theirs}"}
        self.subscriber = spawn.Process(target=subscribe, args=(endpoints, child), daemon=True)
        self.subscriber.start()
        assert self.conn.recv() == "connected"
        self.ours = ZmqEventPublisher(
            endpoints["pagedkv"], f"tcp://127.0.0.1:{ours_replay}", self.encoder
        )
        # As vLLM's EventPublisherFactory builds it from a KVEventsConfig: the defaults,
        # a bind address ("*": vLLM connects to any other) and a replay endpoint.
        self.theirs = kv_events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"tcp://*:{theirs}",
            replay_endpoint=f"tcp://*:{theirs_replay}",
        )
        theirs_publish = self.theirs.publish

        def build_and_publish(events: Events) -> None:
            theirs_publish(vllm.built(events))

        # method -> (its publisher's socket, what it is handed, its publish)
        self.methods: dict[str, tuple[str, Callable[[Events], Any], Callable[[Any], object]]] = {
            METHODS[0]: ("pagedkv", lambda events: events, self.ours.publish),
            METHODS[1]: ("vllm", vllm.decoded, theirs_publish),
            METHODS[2]: ("vllm", lambda events: events, build_and_publish),
        }
        for socket_name, method in (("pagedkv", METHODS[0]), ("vllm", METHODS[1])):
            self._connect(socket_name, method)

    def _connect(self, socket_name: str, method: str) -> None:
        """Publish empty batches until the subscriber hears one (a subscriber that joins
        late misses what came before, unknowing), then let the last ones drain."""
        _, make, publish = self.methods[method]
        for _ in range(100):
            publish(make(()))
            self.conn.send((socket_name, 0))
            if self.conn.recv():
                self.conn.send((socket_name, 0))
                self.conn.recv()
                return
        raise RuntimeError(f"the subscriber never heard {method}")

    def handed(self, method: str, batches: Sequence[Events]) -> list[Any]:
        """What ``method`` is handed for ``batches``."""
        make = self.methods[method][1]
        return [make(events) for events in batches]

    def round(self, method: str, handed: Sequence[Any]) -> float:
        """Publish ``handed`` through ``method``; batches/s until the subscriber has the
        last."""
        socket_name, _, publish = self.methods[method]
        self.conn.send((socket_name, len(handed)))
        start = time.perf_counter()
        for batch in handed:
            publish(batch)
        arrived = self.conn.recv()
        elapsed = time.perf_counter() - start
        if arrived != len(handed):
            raise RuntimeError(f"{method}: {arrived} of {len(handed)} batches arrived in order")
        return len(handed) / elapsed

    def close(self) -> None:
        self.conn.send(None)
        self.subscriber.join(timeout=10)
        self.ours.close()
        self.theirs.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print one table; returns the exit status."""
    parser = OneLineParser(
        prog=PROG,
        description="KV event batches/s: pagedkv's ZmqEventPublisher against vLLM 0.33's on "
        "the same batches (empty, and a trace's through the allocator), received whole by a "
        "ZeroMQ subscriber process; medians over --repeats rounds after a warm-up, taking "
        "turns.",
    )
    parser.add_argument("--batches", type=int_in(1), default=10_000, help="batches a round")
    parser.add_argument("--repeats", type=int_in(1), default=5, help="timed rounds (median)")
    parser.add_argument(
        "--requests", type=int_in(1), default=1_000, help="requests in the trace (default 1000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    args = parser.parse_args(argv)
    try:
        import vllm.distributed.kv_events  # noqa: F401, PLC0415
    except ImportError:
        return fail(PROG, "needs vLLM 0.33 (pip install 'pagedkv[conformance]')")
    return run_interruptible(PROG, lambda: _compare(args))


def _compare(args: argparse.Namespace) -> int:
    count, repeats = args.batches, args.repeats
    sets: dict[str, list[Events]] = {
        "empty": [()] * count,
        "trace": trace_batches(count, args.requests, args.seed),
    }
    bench = Bench()
    try:
        rates: dict[tuple[str, str], list[float]] = {(s, m): [] for s in sets for m in METHODS}
        for set_name, batches in sets.items():
            handed = {method: bench.handed(method, batches) for method in METHODS}
            # NOTE: the batches and the trace are millions of objects: without a freeze the
            # cyclic GC walks them all now and then, inside a round (as in bench.prefix).
            gc.collect()
            gc.freeze()
            for method in METHODS:  # warm-up
                bench.round(method, handed[method])
            for repeat in range(repeats):
                for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
                    print(f"  {set_name}: {method}, round {repeat + 1}/{repeats}", file=sys.stderr)
                    rates[set_name, method].append(bench.round(method, handed[method]))
    finally:
        bench.close()
    trace = sets["trace"]
    events = sum(len(batch) for batch in trace) / count
    payload = sum(len(bench.encoder.encode(EventBatch(0, b), 0.0)) for b in trace) / count
    print(
        f"{count:,} batches a round, median of {repeats} after a warm-up, load "
        f"{os.getloadavg()[0]:.1f}; trace: {args.requests:,} requests, seed {args.seed}, "
        f"{events:.1f} events and {payload:,.0f} bytes a batch"
    )
    print(f"| batches/s | {' | '.join(METHODS)} | pagedkv / ready made | pagedkv / building |")
    print("|---|---|---|---|---|---|")
    for set_name in sets:
        ours, ready, building = (statistics.median(rates[set_name, m]) for m in METHODS)
        print(
            f"| {set_name} | {ours:,.0f} | {ready:,.0f} | {building:,.0f} "
            f"| {ours / ready:.2f} | {ours / building:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
