"""KV cache events published over ZeroMQ as vLLM publishes them, for a router to consume.

``ZmqEventPublisher`` binds a PUB socket and sends each batch as three frames, ``(topic,
seq, payload)``: ``seq`` 8 bytes big-endian, the payload ``harness.kv_wire``'s msgpack. A
ROUTER socket beside it serves replay: a consumer that saw a gap sends ``(b"", start
seq)`` (8 bytes big-endian) and gets back every batch it still buffers from ``start`` on
as ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``. That is vLLM's
``ZmqEventPublisher`` protocol (``vllm/distributed/kv_events.py``), which Dynamo's
indexer speaks. As vLLM does, one thread owns both sockets (ZeroMQ sockets are not
thread-safe): ``publish`` only queues.

Two choices differ from vLLM's, both TensorRT-LLM's: batch numbers start at the clock in
nanoseconds instead of 0, so that a restarted producer's numbers still go up (Dynamo's
indexer 1.6.1 silently drops every batch numbered at or below the last it applied, so
vLLM's restart at 0 is ignored until it passes the old count), and the stream opens with
``AllBlocksCleared`` (``spec.event_stream``: a producer that starts resyncs), so a
consumer that knew an earlier producer on the same endpoint drops what it knew.

``KVEventStream`` is the manager's event sinks that feed it (the device caches' and the
host prefix cache's), and an engine observer: it turns each event (``spec.events``, keyed
by block) into the spec's stream as it comes (``impl.event_publisher``: keys by block
hash, medium ``"GPU"`` or ``"CPU"``), and when the engine tells it the step is over
(after the forward wrote the step's K/V, as vLLM publishes) it publishes the step's as
one batch, if there are any.
"""

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from harness.kv_events import KVEventLog
from harness.kv_wire import WireEncoder
from harness.runtime.events import PoolEvent
from impl import KVCacheManager
from impl.event_publisher import EventPublisher
from impl.prefix_cache import EventSink
from spec.event_stream import EventBatch, StreamEvent, compute_resync_events
from spec.events import KVCacheEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How many batches replay can serve (vLLM's default ``buffer_steps``).
REPLAY_BATCHES = 10_000
# NOTE: ZeroMQ's default high-water mark is 1,000 messages a socket, past which PUB and
# ROUTER drop what they send without a word: a burst of 10,000 small batches to a
# subscriber that was busy lost 1,701, and a replay of 10,000 1-KB batches lost 4,000
# (measured on loopback). vLLM's marks: 100,000 for PUB, twice the buffer for replay.
PUB_HWM = 100_000
REPLAY_HWM = 2 * (REPLAY_BATCHES + 1)
# How long the idle thread waits for a batch before it looks at the sockets again: the
# longest a replay request waits while nothing is published (a batch waits for nothing);
# while batches are queued, it looks again after each BURST_BATCHES of them.
IDLE_POLL_S = 0.01
BURST_BATCHES = 100
# NOTE: three sends with an int flag, not ``send_multipart``: pyzmq 27.3's checks of each
# part and its enum flag arithmetic made that 8.5 us a batch, the three sends 2.1 us.
_MORE = int(zmq.SNDMORE)
# How long ``close`` sends what is still queued before it drops the rest, and how long
# ZeroMQ may then take to deliver what was sent (in the background: ``close`` returns).
CLOSE_TIMEOUT_S = 5.0
LINGER_MS = 1000


class ZmqEventPublisher:
    """PUB at ``endpoint``, replay ROUTER at ``replay_endpoint`` (both bound, IPv4 or IPv6;
    e.g. ``tcp://127.0.0.1:5557``, ``tcp://[::1]:5557``); ``encoder`` writes the payloads.

    A subscriber that connects after a batch is sent never sees it (ZeroMQ's "slow
    joiner"), and a consumer that never saw a batch cannot know it missed it: so the
    publisher waits up to ``subscriber_wait_s`` after binding for a first subscription
    (its PUB socket is an XPUB, which hears them) before it sends anything.
    ``sent_batches`` and ``sent_events`` count what went out; ``close`` says what did not.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        encoder: WireEncoder,
        topic: str = "",
        subscriber_wait_s: float = 0.0,
    ) -> None:
        self.encoder = encoder
        self.topic = topic.encode("utf-8")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self.sent_batches = 0
        self.sent_events = 0
        # Each batch with the time it was published; None: close.
        self._queue: queue.Queue[tuple[EventBatch, float] | None] = queue.Queue()
        self._next_seq = time.time_ns()
        self._deadline = math.inf  # close's: past it, the thread drops what is queued
        self._dropped = 0
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.XPUB)
        self._replay = context.socket(zmq.ROUTER)
        for sock, hwm in ((self._pub, PUB_HWM), (self._replay, REPLAY_HWM)):
            sock.setsockopt(zmq.IPV6, 1)  # an IPv6 address binds; IPv4 ones still do
            sock.setsockopt(zmq.SNDHWM, hwm)
        try:
            self._pub.bind(endpoint)
            self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            raise OSError(f"cannot bind {endpoint} and {replay_endpoint}: {error}") from None
        self.subscribed = bool(self._pub.poll(int(subscriber_wait_s * 1000)))
        self._thread = threading.Thread(target=self._serve, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[StreamEvent]) -> EventBatch:
        """Number ``events`` as the next batch and queue it for sending; the batch."""
        batch = EventBatch(self._next_seq, tuple(events))
        self._next_seq += 1
        # NOTE: encoded in the thread, as vLLM does: the caller's step does not wait for it.
        self._queue.put((batch, time.time()))
        return batch

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> int:
        """Send what is queued for up to ``timeout_s`` seconds, drop the rest, close both
        sockets; the number of batches dropped. Bounded whatever the subscribers do: a
        PUB socket never waits for one (past its high-water mark it drops)."""
        self._deadline = time.monotonic() + timeout_s
        self._queue.put(None)
        self._thread.join()
        self._pub.close(linger=LINGER_MS)
        self._replay.close(linger=LINGER_MS)
        return self._dropped

    def _serve(self) -> None:
        """The sockets' thread: send the queued batches as they come, and between two
        bursts of them answer replay requests (and hear subscriptions) without waiting."""
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(0))
            if self._pub in ready:
                self._pub.recv_multipart()  # a subscription coming or going: nothing to do
            if self._replay in ready:
                self._answer_replay(self._replay.recv_multipart())
            burst = self._take_burst()
            for index, item in enumerate(burst):
                if item is None:
                    return
                if time.monotonic() > self._deadline:
                    self._dropped = self._count_dropped(burst[index:])
                    return
                batch, ts = item
                payload = self.encoder.encode(batch, ts)
                self.buffer.append((batch.seq, payload))
                self.send(batch.seq, payload)
                self.sent_batches += 1
                self.sent_events += len(batch.events)

    def _take_burst(self) -> list[tuple[EventBatch, float] | None]:
        """The next queued batches, at most ``BURST_BATCHES`` (none if none came within
        ``IDLE_POLL_S``)."""
        try:
            burst = [self._queue.get(timeout=IDLE_POLL_S)]
        except queue.Empty:
            return []
        try:
            while len(burst) < BURST_BATCHES:
                burst.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return burst

    def _count_dropped(self, rest: list[tuple[EventBatch, float] | None]) -> int:
        """The batches of ``rest`` and those still queued (close's None aside)."""
        while True:
            try:
                rest.append(self._queue.get_nowait())
            except queue.Empty:
                return sum(item is not None for item in rest)

    def send(self, seq: int, payload: bytes) -> None:
        """Put one batch on the PUB socket (a test's lossy publisher overrides this)."""
        self._pub.send(self.topic, _MORE)
        self._pub.send(seq.to_bytes(8, "big"), _MORE)
        self._pub.send(payload)

    def _answer_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return  # not a replay request: (identity, b"", start seq)
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (identity, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))


class KVEventStream(KVEventLog):
    """A manager's event sinks that also publish: the events gathered since the last
    batch, as one batch of the spec's stream, at the end of each engine step (as the
    engine's observer) and at ``flush`` and ``close``."""

    __slots__ = ("_stream", "publisher")

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        super().__init__()
        self.publisher = publisher
        self._stream = EventPublisher(publisher.encoder.block_size)
        publisher.publish(compute_resync_events(frozenset(), publisher.encoder.block_size))

    def record(self, event: KVCacheEvent) -> None:
        super().record(event)
        self._stream.record(event)

    @property
    def host_sink(self) -> EventSink:
        """The host prefix cache's events are published too, as medium ``"CPU"``."""
        return self._stream.record_host

    def __call__(self, event: PoolEvent, manager: KVCacheManager) -> None:
        """The observer: a step is over, publish its events."""
        if event.kind == "step":
            self.flush()

    def flush(self) -> None:
        """Publish the events gathered so far as one batch (none if there are none)."""
        self._publish(self._stream.end_step())

    def resync(self) -> None:
        """Publish ``AllBlocksCleared`` and a store of every present key: what a producer
        sends when its consumers may have lost track."""
        self._publish(self._stream.resync())

    def _publish(self, batches: tuple[EventBatch, ...]) -> None:
        """Publish each batch's events under the publisher's own batch numbers."""
        for batch in batches:
            self.publisher.publish(batch.events)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> int:
        """Publish the last step's events and close the publisher (``timeout_s``: its
        ``close``'s); the batches it dropped."""
        self.flush()
        return self.publisher.close(timeout_s)
