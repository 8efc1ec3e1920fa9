"""``--events``: where the run's KV cache events go. A path writes them as JSON lines
(``harness.kv_events``) at the end; ``zmq://HOST:PORT`` publishes them while the run goes,
in vLLM's wire format (``--events-format``), on a PUB socket bound at HOST:PORT with the
replay socket at HOST:PORT+1, for a router such as Dynamo's indexer to subscribe to."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from harness.cli.output import check_writable
from harness.cli.parsing import UsageError
from harness.kv_publisher import KVEventStream, ZmqEventPublisher
from harness.kv_wire import WIRE_FORMATS, WireEncoder, WireFormat

SCHEME = "zmq://"
# How long the command waits after binding for a router to subscribe before it publishes
# (a router that connects later misses the first batches without knowing it).
SUBSCRIBER_WAIT_S = 5.0


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
    socket's), else a file path."""
    if not text.startswith(SCHEME):
        return Path(text)
    host, colon, port = text[len(SCHEME) :].rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not zmq://HOST:PORT with PORT in 1..65534 (PORT+1 serves replay)"
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
