"""KV cache events as the stream a router consumes: what it means, and the producer's side.

``spec.events`` says which block of which group caches which key; a router never sees
blocks. What it is told, and keeps, is which keys are **present** in each (KV cache group,
medium): ``KeyStored`` when a key becomes present there, ``KeyRemoved`` when it stops
being present, ``AllBlocksCleared`` when every key of every group and medium leaves at
once (``reset_prefix_cache``). Presence, not copies: a key two blocks of one group and
medium hold is one present key, stored when the first copy appears and removed when the
last one goes. Medium ``"GPU"`` is the device pool (vLLM's name for its device tier,
whatever the device is), ``"CPU"`` the host prefix cache (``spec.host_tier``).

On the wire a key is its block hash (``spec.block_hash``): a ``KeyStored`` carries the
hash, its parent's (``None`` for a first block), the block's own ``block_size`` tokens and
the salt of a first block, so that a router that hashes prompts itself (llm-d) or keeps a
radix tree of token blocks (Dynamo) can place it.

Batches. A producer publishes each step's events as one ``EventBatch`` whose ``seq`` is
one more than the last batch's (any start; a step without events publishes none). A
consumer that misses batches asks for them again or, when they are gone, drops what it
knows and waits for a resync: ``AllBlocksCleared`` then a ``KeyStored`` for every present
key (``compute_resync_events``), as TensorRT-LLM's publisher sends when it loses events
itself. A producer that (re)starts opens with a resync for the same reason.

What a consumer keeps, and when a stream is correct: ``spec.event_consumers``.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

from spec.block_hash import (
    compute_block_hash,
    compute_external_hash,
    compute_extra_keys,
    iter_block_hashes,
)
from spec.events import AllBlocksCleared, CachedBlock, KVCacheEvent, replay_events
from spec.records import CacheKey
from spec.state import AllocatorState

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class PresentKey(NamedTuple):
    """A key present in one KV cache group and medium of a producer's caches."""

    group: int
    medium: str
    key: CacheKey


class StreamKey(NamedTuple):
    """What a consumer knows a present key by: its group, medium and block hash."""

    group: int
    medium: str
    block_hash: int


@dataclass(frozen=True, slots=True)
class KeyStored:
    """Key ``block_hash`` became present in (``group``, ``medium``): a block of
    ``token_ids`` after the block hashed ``parent_block_hash`` (``None``: a first block,
    cached under ``cache_salt``; the salt is ``None`` past the first block, the parent's
    hash carries it)."""

    group: int
    medium: str
    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class KeyRemoved:
    """Key ``block_hash`` is present in (``group``, ``medium``) no more."""

    group: int
    medium: str
    block_hash: int


StreamEvent = KeyStored | KeyRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events one step published, in order, numbered ``seq``."""

    seq: int
    events: tuple[StreamEvent, ...]


# The rules a stream can break (``StreamError.rule``): ``seq`` (a batch number skips or
# repeats), ``clear`` (a reset without ``AllBlocksCleared``), ``key`` (a store names its
# key unlike the hash rule), ``stored_twice`` (a store of a present key), ``parent_order``
# (a store before its parent), ``unstored`` (a remove with no store left), ``extra`` or
# ``missing`` (a consumer holds a key the caches do not, or lacks one they hold).
StreamRule = Literal[
    "seq", "clear", "key", "stored_twice", "parent_order", "unstored", "extra", "missing"
]


class StreamError(ValueError):
    """A stream that is not a correct stream of the steps it is checked against; ``rule``
    names the rule it breaks (``StreamRule``)."""

    def __init__(self, message: str, rule: StreamRule) -> None:
        super().__init__(message)
        self.rule = rule


# -- the producer's side --------------------------------------------------------------------


def get_present_keys(state: AllocatorState) -> frozenset[PresentKey]:
    """Every key present in ``state``: each group's device cache, and its host cache when
    the host tier keeps demoted prefixes."""
    device = (
        PresentKey(group, MEDIUM_GPU, key)
        for group, cache in enumerate(state.group_caches)
        for key in cache
    )
    return frozenset(device) | get_host_keys(state)


def get_host_keys(state: AllocatorState) -> frozenset[PresentKey]:
    """The keys present on the host (medium ``"CPU"``): each group's host prefix cache."""
    return frozenset(
        PresentKey(group, MEDIUM_CPU, key)
        for group, cache in enumerate(state.host.host_caches)
        for key in cache
    )


@lru_cache(maxsize=1 << 16)
def compute_key_stored(present: PresentKey, block_size: int) -> KeyStored:
    """The ``KeyStored`` that says ``present`` became present. O(prefix); cached, as the
    checker names the same keys at every step."""
    parent_hash = compute_parent_hash(present.key, block_size)
    return compute_key_stored_after(present, parent_hash, block_size)[0]


def compute_parent_hash(key: CacheKey, block_size: int) -> bytes | None:
    """The hash of the prefix before ``key``'s last block (``None``: a first block)."""
    parent = key.token_ids[:-block_size]
    *_, last = (None, *iter_block_hashes(parent, block_size, key.cache_salt))
    return last


def compute_key_stored_after(
    present: PresentKey, parent_hash: bytes | None, block_size: int
) -> tuple[KeyStored, bytes]:
    """``compute_key_stored`` given the hash of the key's parent prefix (``None``: a first
    block), in O(block_size); and the key's own hash, the next block's parent hash."""
    key = present.key
    index = len(key.token_ids) // block_size - 1
    token_ids = key.token_ids[-block_size:]
    own = compute_block_hash(parent_hash, token_ids, compute_extra_keys(index, key.cache_salt))
    stored = KeyStored(
        group=present.group,
        medium=present.medium,
        block_hash=compute_external_hash(own),
        parent_block_hash=None if parent_hash is None else compute_external_hash(parent_hash),
        token_ids=token_ids,
        cache_salt=key.cache_salt if parent_hash is None else None,
    )
    return stored, own


def compute_stream_key(present: PresentKey, block_size: int) -> StreamKey:
    """What a consumer knows ``present`` by."""
    stored = compute_key_stored(present, block_size)
    return StreamKey(stored.group, stored.medium, stored.block_hash)


def _in_chain_order(keys: Iterable[PresentKey]) -> list[PresentKey]:
    """Parents before children, then a fixed order, so every stream is reproducible."""

    def order(present: PresentKey) -> tuple[int, str, int, bool, str, tuple[int, ...]]:
        salt = present.key.cache_salt
        tokens = present.key.token_ids
        return (present.group, present.medium, len(tokens), salt is None, salt or "", tokens)

    return sorted(keys, key=order)


def compute_step_events(
    before: frozenset[PresentKey], after: frozenset[PresentKey], reset: bool, block_size: int
) -> tuple[StreamEvent, ...]:
    """The events of a step that took the present keys from ``before`` to ``after``:
    with a reset, ``AllBlocksCleared`` then a store of each key of ``after``; otherwise a
    remove of each key that left (children first), then a store of each that came
    (parents first). One correct stream among many (``check_stream`` accepts any)."""
    if reset:
        return compute_resync_events(after, block_size)
    removed = reversed(_in_chain_order(before - after))
    stored = _in_chain_order(after - before)
    return (
        *(_key_removed(p, block_size) for p in removed),
        *(compute_key_stored(p, block_size) for p in stored),
    )


def _key_removed(present: PresentKey, block_size: int) -> KeyRemoved:
    return KeyRemoved(*compute_stream_key(present, block_size))


def compute_resync_events(keys: frozenset[PresentKey], block_size: int) -> tuple[StreamEvent, ...]:
    """What a producer sends when its consumers may have lost track: ``AllBlocksCleared``,
    then a store of every present key, parents first."""
    return (AllBlocksCleared(), *(compute_key_stored(p, block_size) for p in _in_chain_order(keys)))


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """What a publisher remembers of pagedkv's block-keyed events (``spec.events``): the
    key each (group, block) caches, as ``replay_events`` rebuilds it."""

    block_size: int
    view: frozenset[CachedBlock] = frozenset()


def translate_events(
    blocks: BlockKeys, events: Iterable[KVCacheEvent]
) -> tuple[BlockKeys, tuple[StreamEvent, ...]]:
    """pagedkv's device events as stream events (medium ``"GPU"``), one for one: a cache
    holds a key in one block per group, so a block's key entering or leaving is the key's
    presence changing. ``spec.EventReplayError`` for an event the view contradicts.
    O(view) per event."""
    view = blocks.view
    out: list[StreamEvent] = []
    for event in events:
        after = replay_events((event,), view)
        if isinstance(event, AllBlocksCleared):
            out.append(event)
            view = after
            continue
        for entry in view - after:
            out.append(_key_removed(_device_key(entry), blocks.block_size))
        for entry in after - view:
            out.append(compute_key_stored(_device_key(entry), blocks.block_size))
        view = after
    return BlockKeys(blocks.block_size, view), tuple(out)


def compute_state_events(
    blocks: BlockKeys, host_before: frozenset[PresentKey], state: AllocatorState
) -> tuple[BlockKeys, tuple[StreamEvent, ...]]:
    """The stream of the step that left ``state`` (read before ``take_events``) from a
    publisher that remembers ``blocks`` and the host keys ``host_before``: the step's
    device events translated, then the host prefix cache's changes (medium ``"CPU"``; the
    spec's host tier emits no events, so they are the difference of its keys, a reset's
    ``AllBlocksCleared`` having cleared the old ones)."""
    blocks, events = translate_events(blocks, state.events)
    if any(isinstance(event, AllBlocksCleared) for event in events):
        host_before = frozenset()
    host = compute_step_events(host_before, get_host_keys(state), False, blocks.block_size)
    return blocks, events + host


def _device_key(entry: CachedBlock) -> PresentKey:
    return PresentKey(entry.group, MEDIUM_GPU, entry.key)
