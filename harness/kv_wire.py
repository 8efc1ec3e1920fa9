"""KV cache events on vLLM's wire: the spec's stream (``spec.event_stream``) as the
msgpack payloads vLLM's ``ZmqEventPublisher`` sends.

A payload is a ``KVEventBatch``, always a positional array ``[ts, events,
data_parallel_rank]``; each event is tagged with its type, and is either a map of its
fields (``"vllm"``: vLLM since #42892, June 2026) or a positional array after the tag
(``"vllm-array"``: vLLM up to 0.23, and every consumer written before the change). The
fields, their order and their defaults are vLLM 0.33's (``vllm/distributed/kv_events.py``),
which ``tests/events/test_kv_wire.py`` decodes our payloads with; pagedkv fills the ones
it has: one block hash per ``BlockStored`` (the spec's key), the block's tokens, the
salt as the first block's ``extra_keys`` entry, the medium, the group and its kind. No
LoRA, so ``lora_id`` and ``lora_name`` are always null.

Not the transport (``harness.kv_publisher``), and not what the keys mean (the spec).
"""

from collections.abc import Sequence
from typing import Literal

import msgspec

from spec.block_hash import salt_extra_key
from spec.event_stream import EventBatch, KeyRemoved, KeyStored, StreamEvent

WireFormat = Literal["vllm", "vllm-array"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("vllm", "vllm-array")


# NOTE: tuples where vLLM has lists (both are msgpack arrays): a tuple of the spec's event
# goes out as it is, and a constant one needs no allocation. Building the structs was
# two-thirds of encoding a batch (33 us for 37 events, where vLLM encodes its own in 17).


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``BlockStored``, field for field (a map on the wire)."""

    block_hashes: tuple[int]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[str | bytes] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``BlockRemoved`` (a map on the wire)."""

    block_hashes: tuple[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``AllBlocksCleared`` (a map of its tag alone)."""


class ArrayBlockStored(BlockStored, tag="BlockStored", array_like=True):
    """The same, as a positional array after its tag (vLLM up to 0.23)."""


class ArrayBlockRemoved(BlockRemoved, tag="BlockRemoved", array_like=True):
    """The same, as a positional array after its tag."""


class ArrayAllBlocksCleared(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    """The same, as an array of its tag alone."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: always ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
# vLLM's untagged extra keys of a block without a salt.
_UNSALTED: tuple[None] = (None,)


class WireEncoder:
    """Encodes a producer's batches for one pool: its block size and KV cache groups
    (``group_windows``: ``None`` full attention, W a sliding window), in one format."""

    __slots__ = (
        "_cleared",
        "_group_kinds",
        "_removed",
        "_stored",
        "block_size",
        "group_windows",
        "wire_format",
    )

    def __init__(
        self, block_size: int, group_windows: Sequence[int | None], wire_format: WireFormat
    ) -> None:
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {wire_format!r}")
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.wire_format = wire_format
        array = wire_format == "vllm-array"
        self._stored = ArrayBlockStored if array else BlockStored
        self._removed = ArrayBlockRemoved if array else BlockRemoved
        self._cleared = ArrayAllBlocksCleared() if array else AllBlocksCleared()
        self._group_kinds = tuple(
            ("full_attention" if window is None else "sliding_window", window)
            for window in self.group_windows
        )

    def encode(self, batch: EventBatch, ts: float, data_parallel_rank: int = 0) -> bytes:
        """The payload of ``batch`` (its ``seq`` travels in a frame of its own)."""
        events = [self._wire_event(event) for event in batch.events]
        return _ENCODER.encode(KVEventBatch(ts, events, data_parallel_rank))

    def _wire_event(self, event: StreamEvent) -> WireEvent:
        if isinstance(event, KeyStored):
            kind, window = self._group_kinds[event.group]
            salt = event.cache_salt
            return self._stored(
                (event.block_hash,),
                event.parent_block_hash,
                event.token_ids,
                self.block_size,
                None,  # lora_id
                event.medium,
                None,  # lora_name
                # vLLM's untagged extra keys: the salt alone, on a first block only.
                _UNSALTED if salt is None else ((salt_extra_key(salt),),),
                event.group,
                kind,
                window,
            )
        if isinstance(event, KeyRemoved):
            return self._removed((event.block_hash,), event.medium, event.group)
        return self._cleared
