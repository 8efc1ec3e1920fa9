"""``--events``: where the run's KV cache events go. A path writes them as JSON lines
(``harness.kv_events``) at the end; ``zmq://HOST:PORT`` publishes them while the run goes,
in vLLM's wire format (``--events-format``), on a PUB socket bound at HOST:PORT with the
replay socket at HOST:PORT+1, for a router such as Dynamo's indexer to subscribe to
(HOST an IPv6 address in brackets, ``zmq://[::1]:5557``, binds too). A bare
``HOST:PORT`` and another scheme are refused rather than taken for file names.
The options themselves, the target, the publishing sink, the observer that makes it
publish each step and the line that says what went out are here; the main command calls
them."""

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from harness.kv_events import KVEventLog
from harness.kv_publisher import CLOSE_TIMEOUT_S, KVEventStream, ZmqEventPublisher
from harness.kv_wire import WIRE_FORMATS, WireEncoder, WireFormat
from harness.output_files import check_writable
from harness.parsing import UsageError
from harness.runtime.events import PoolEvent, PoolObserver
from impl import KVCacheManager

SCHEME = "zmq://"
# How long the command waits after binding for a router to subscribe before it publishes
# (a router that connects later misses the first batches without knowing it).
SUBSCRIBER_WAIT_S = 5.0
# What a forgotten scheme looks like: a host name, an IPv4 address or a bracketed IPv6
# one, a colon and a port.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]+")


@dataclass(frozen=True, slots=True)
class ZmqTarget:
    """A TCP address to bind the PUB socket at; the replay socket takes the next port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{SCHEME}{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"


EventsTarget = Path | ZmqTarget


def parse_events_target(text: str) -> EventsTarget:
    """``--events``'s value: ``zmq://HOST:PORT`` (PORT in 1..65534: PORT+1 is the replay
    socket's; an IPv6 HOST in brackets), else a file path that is neither ``HOST:PORT``
    nor ``SCHEME://...``."""
    if not text.startswith(SCHEME):
        if _HOST_PORT.fullmatch(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is an address, not a file: write zmq://{text} to publish there "
                f"(./{text} for a file of that name)"
            )
        if "://" in text:
            raise argparse.ArgumentTypeError(f"{text!r}: the one scheme is zmq://HOST:PORT")
        return Path(text)
    host, colon, port = text[len(SCHEME) :].rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not zmq://HOST:PORT with PORT in 1..65534 (PORT+1 serves replay)"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: an IPv6 address goes in brackets, zmq://[{host}]:{port}"
        )
    return ZmqTarget(host, int(port))


def check_events_target(target: EventsTarget | None, wire_format: WireFormat | None) -> None:
    """Refuse, before the model loads, a file that cannot be written or a format given
    without a ZeroMQ target (a file has one format of its own)."""
    if isinstance(target, Path):
        check_writable("--events", target)
    if wire_format is not None and not isinstance(target, ZmqTarget):
        raise UsageError(f"--events-format {wire_format} needs --events zmq://HOST:PORT")


def open_event_stream(
    target: ZmqTarget,
    wire_format: WireFormat | None,
    block_size: int,
    group_windows: tuple[int | None, ...],
) -> KVEventStream:
    """Bind ``target`` and return the sink that publishes there; ``UsageError`` (one line)
    when the address cannot be bound."""
    encoder = WireEncoder(block_size, group_windows, wire_format or WIRE_FORMATS[0])
    try:
        publisher = ZmqEventPublisher(
            target.endpoint, target.replay_endpoint, encoder, subscriber_wait_s=SUBSCRIBER_WAIT_S
        )
    except OSError as error:
        raise UsageError(f"--events {target}: {error}") from None
    return KVEventStream(publisher)


def close_event_stream(
    stream: KVEventStream, target: ZmqTarget, timeout_s: float = CLOSE_TIMEOUT_S
) -> str:
    """Publish the last step's events and close, sending what is queued for up to
    ``timeout_s``; the line that says what went out (every batch sent: the opening
    ``AllBlocksCleared``, device and host events) and what closing dropped."""
    dropped = stream.close(timeout_s)
    publisher = stream.publisher
    sent = f"{publisher.sent_events} KV cache events in {publisher.sent_batches} batches"
    if not dropped:
        return f"published {sent} at {target}"
    return f"published {sent} at {target}; {dropped} batches not sent within {timeout_s:g} s"


def add_event_options(parser: argparse.ArgumentParser) -> None:
    """The main command's ``--events`` and ``--events-format``."""
    parser.add_argument(
        "--events",
        type=parse_events_target,
        default=None,
        metavar="FILE.jsonl|zmq://HOST:PORT",
        help="the KV cache events of the continuous-batching run. FILE.jsonl: written at the "
        "end, one JSON object per line in the order the cache changed: type (BlockStored, "
        "BlockRemoved, AllBlocksCleared), step, block_id, group, and for BlockStored "
        "parent_block_id, token_ids (past the parent's key) and cache_salt; "
        "spec.replay_events rebuilds the cache from them. zmq://HOST:PORT: published while "
        "the run goes, as vLLM publishes them (a ZeroMQ PUB socket bound at HOST:PORT, an "
        "IPv6 HOST in brackets, "
        "frames (topic, 8-byte sequence number, msgpack batch), one batch per engine step, "
        "keys as block hashes; replay of missed batches at HOST:PORT+1), for a KV-aware "
        "router such as Dynamo's indexer to subscribe to; the run waits up to "
        f"{SUBSCRIBER_WAIT_S:g} s after binding for a first subscriber",
    )
    parser.add_argument(
        "--events-format",
        choices=WIRE_FORMATS,
        default=None,
        help="with --events zmq://...: each event as a map of its fields (vllm, the "
        "default: vLLM since June 2026) or a positional array (vllm-array: vLLM up to "
        "0.23 and the consumers written for it)",
    )


def with_event_publisher(
    observer: PoolObserver | None, kv_events: KVEventLog | None
) -> PoolObserver | None:
    """What watches the batched run: ``observer`` and, when the events are published, the
    publisher too (it publishes at the end of each step)."""
    if not isinstance(kv_events, KVEventStream):
        return observer
    if observer is None:
        return kv_events
    observers = (observer, kv_events)

    def both(event: PoolEvent, manager: KVCacheManager) -> None:
        for each in observers:
            each(event, manager)

    return both
