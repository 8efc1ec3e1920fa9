"""What pagedkv sends decodes with vLLM 0.33's own ``vllm.distributed.kv_events`` classes, in
both encodings, and travels as vLLM's ZeroMQ frames with replay."""

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from harness.kv_publisher import END_SEQ, ZmqEventPublisher
from harness.kv_wire import WireEncoder, WireFormat
from spec.event_stream import EventBatch, KeyRemoved, KeyStored
from spec.events import AllBlocksCleared
from tests.events.loopback import Wire, open_wire, receive

pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM (the conformance extra)")
from vllm.distributed import kv_events


# vLLM up to 0.23 declared its events ``array_like=True``; #42892 dropped that. The same
# classes of vLLM 0.33 with the old setting back decode the old encoding.
class OldBlockStored(kv_events.BlockStored, tag="BlockStored", array_like=True):
    pass


class OldBlockRemoved(kv_events.BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class OldAllBlocksCleared(kv_events.AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


class OldKVEventBatch(kv_events.EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "vllm": msgspec.msgpack.Decoder(kv_events.KVEventBatch),
    "vllm-array": msgspec.msgpack.Decoder(OldKVEventBatch),
}

BATCH = EventBatch(
    41,
    (
        KeyStored(0, "GPU", 2**64 - 1, None, (1, 2, 3, 4), "tenant"),
        KeyStored(1, "GPU", 12, 11, (5, 6, 7, 8), None),
        KeyRemoved(0, "CPU", 99),
        AllBlocksCleared(),
    ),
)


@pytest.mark.parametrize("wire_format", ["vllm", "vllm-array"])
def test_a_batch_decodes_with_vllm_s_own_classes(wire_format: WireFormat) -> None:
    payload = WireEncoder(4, (None, 8), wire_format).encode(BATCH, ts=12.5, data_parallel_rank=0)
    batch = DECODERS[wire_format].decode(payload)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 0)
    salted, windowed, removed, cleared = batch.events
    assert (salted.block_hashes, salted.parent_block_hash, salted.token_ids) == (
        [2**64 - 1],
        None,
        [1, 2, 3, 4],
    )
    assert (salted.block_size, salted.medium, salted.extra_keys) == (4, "GPU", [("tenant",)])
    assert (salted.group_idx, salted.kv_cache_spec_kind) == (0, "full_attention")
    assert (salted.lora_id, salted.lora_name) == (None, None)
    assert (windowed.parent_block_hash, windowed.extra_keys, windowed.group_idx) == (11, [None], 1)
    assert (windowed.kv_cache_spec_kind, windowed.kv_cache_spec_sliding_window) == (
        "sliding_window",
        8,
    )
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([99], "CPU", 0)
    assert type(cleared).__name__.endswith("AllBlocksCleared")


def test_the_two_encodings_differ_only_in_the_shape_of_each_event() -> None:
    as_map = msgspec.msgpack.decode(WireEncoder(4, (None, 8), "vllm").encode(BATCH, ts=1.0))
    as_array = msgspec.msgpack.decode(WireEncoder(4, (None, 8), "vllm-array").encode(BATCH, ts=1.0))
    assert isinstance(as_map, list) and isinstance(as_array, list)  # the batch: an array
    assert [e["type"] for e in as_map[1]] == [e[0] for e in as_array[1]]
    assert as_map[1][3] == {"type": "AllBlocksCleared"} and as_array[1][3] == ["AllBlocksCleared"]
    stored = as_map[1][0]
    fields = list(kv_events.BlockStored.__struct_fields__)
    assert as_array[1][0][1:] == [stored.get(name) for name in fields[: len(as_array[1][0]) - 1]]


@pytest.fixture
def wire() -> Iterator[Wire]:
    with open_wire() as opened:
        yield opened


def test_batches_go_out_as_topic_sequence_and_payload_frames_numbered_one_by_one(
    wire: Wire,
) -> None:
    first = wire.publisher.publish(BATCH.events)
    second = wire.publisher.publish((AllBlocksCleared(),))
    frames = receive(wire.subscriber, 2)
    assert [f[0] for f in frames] == [b"", b""]
    assert [int.from_bytes(f[1], "big") for f in frames] == [first.seq, first.seq + 1]
    assert second.seq == first.seq + 1 and first.seq > time.time_ns() - 60 * 10**9
    assert len(DECODERS["vllm"].decode(frames[0][2]).events) == 4


def test_replay_serves_the_batches_from_the_asked_number_on_then_the_end_marker(
    wire: Wire,
) -> None:
    batches = [wire.publisher.publish((KeyRemoved(0, "GPU", n),)) for n in range(3)]
    receive(wire.subscriber, 3)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{wire.port + 1}")
    try:
        dealer.send_multipart((b"", batches[1].seq.to_bytes(8, "big")))
        replies = receive(dealer, 3)
    finally:
        dealer.close(linger=0)
    assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [b.seq for b in batches[1:]]
    assert [DECODERS["vllm"].decode(r[3]).events[0].block_hashes for r in replies[:2]] == [[1], [2]]
    assert replies[2] == [b"", b"", END_SEQ, b""]


def test_an_address_in_use_is_refused_in_one_line(
    wire: Wire,
) -> None:
    port = wire.port
    with pytest.raises(OSError, match=f"cannot bind tcp://127.0.0.1:{port}"):
        ZmqEventPublisher(
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{port + 1}",
            WireEncoder(4, (None,), "vllm"),
        )


def test_a_salt_utf8_cannot_encode_goes_out_as_its_bytes() -> None:
    """msgpack has no string for a lone surrogate: the extra key carries the bytes the
    block hash is computed over (``spec.block_hash.salt_extra_key``)."""
    batch = EventBatch(0, (KeyStored(0, "GPU", 7, None, (1, 2, 3, 4), "\ud800"),))
    for wire_format in ("vllm", "vllm-array"):
        payload = WireEncoder(4, (None,), wire_format).encode(batch, ts=0.0, data_parallel_rank=0)
        (stored,) = DECODERS[wire_format].decode(payload).events
        assert stored.extra_keys == [(b"\xed\xa0\x80",)]
