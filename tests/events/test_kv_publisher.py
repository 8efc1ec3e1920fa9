"""``harness.kv_publisher.ZmqEventPublisher`` keeps up: every batch published reaches a
subscriber in order, replay serves every batch its buffer holds, and ``close`` stops
sending at its timeout and says how many batches it dropped (no time is asserted)."""

import msgspec
import zmq

from harness.kv_publisher import END_SEQ, REPLAY_BATCHES
from spec.event_stream import KeyStored
from tests.events.loopback import SlowWire, open_wire, receive, wait_for


def stored(n: int, tokens: int) -> tuple[KeyStored]:
    """One store of ``tokens`` token ids, hash ``n``: a payload of ~3 bytes a token."""
    return (KeyStored(0, "GPU", n, None, tuple(range(40_000, 40_000 + tokens)), None),)


def sequence_numbers(frames: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(frame[1], "big") for frame in frames]


def test_a_burst_past_zeromq_s_default_high_water_mark_arrives_whole_and_in_order() -> None:
    """ZeroMQ drops past 1,000 queued messages by default: a subscriber that reads only
    once all 10,000 batches of ~1 KB were sent lost some."""
    with open_wire() as wire:
        batches = [wire.publisher.publish(stored(n, 300)) for n in range(10_000)]
        wait_for(lambda: wire.publisher.sent_batches, lambda sent: sent == 10_000, "the sends")
        frames = receive(wire.subscriber, 10_000)
        assert sequence_numbers(frames) == [batch.seq for batch in batches]
        assert [msgspec.msgpack.decode(f[2])[1][0]["block_hashes"] for f in frames[::2500]] == [
            [0],
            [2500],
            [5000],
            [7500],
        ]
        assert wire.publisher.sent_events == 10_000


def test_replay_serves_every_batch_its_buffer_holds_to_a_consumer_that_reads_late() -> None:
    """A replay of the whole buffer, 10,000 batches of ~1 KB, is queued before the
    consumer reads a reply: ZeroMQ's default high-water mark dropped most of it."""
    with open_wire() as wire:
        batches = [wire.publisher.publish(stored(n, 300)) for n in range(REPLAY_BATCHES)]
        receive(wire.subscriber, REPLAY_BATCHES)
        dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{wire.port + 1}")
        try:
            dealer.send_multipart((b"", batches[0].seq.to_bytes(8, "big")))
            assert dealer.poll(5000), "no replay within 5 s"
            # The thread answers a request whole before it sends the next batch: once this
            # one arrives, every reply has been sent.
            marker = wire.publisher.publish(stored(REPLAY_BATCHES, 1))
            assert sequence_numbers(receive(wire.subscriber, 1)) == [marker.seq]
            replies = receive(dealer, REPLAY_BATCHES + 1)
        finally:
            dealer.close(linger=0)
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [b.seq for b in batches]
    assert replies[-1] == [b"", b"", END_SEQ, b""]


def test_close_sends_until_its_timeout_then_drops_the_rest_and_says_how_many() -> None:
    with open_wire(SlowWire) as wire:
        batches = [wire.publisher.publish(stored(n, 4)) for n in range(50)]
        dropped = wire.publisher.close(timeout_s=0.1)  # 50 batches take >= 1 s to send
        sent = wire.publisher.sent_batches
        assert dropped > 0 and sent + dropped == 50
        frames = receive(wire.subscriber, sent)
        assert sequence_numbers(frames) == [batch.seq for batch in batches[:sent]]
        assert not wire.subscriber.poll(200)  # and nothing dropped went out
