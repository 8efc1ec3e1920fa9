"""KV cache events, the consumer's side: what a router keeps from the stream
(``spec.event_stream``), and the checker that says whether a stream is correct.

Gaps. A consumer that receives ``seq > last + 1`` has missed batches (``is_gap``): it
asks the producer's replay buffer for them (``replay_batches``); when the buffer no
longer holds them, what it knows of the producer can be wrong, so it drops it all and the
producer must resync (``spec.event_stream.compute_resync_events``).

The consumer models the field uses, and what each requires of a producer:
- **a set of keys** (``apply_to_key_set``; Dynamo's standalone indexer 1.6.1, measured):
  a store of a present key changes nothing and a remove drops the key, however
  often it was stored. A remove while a copy remains loses a cached prefix (vLLM #55092).
- **a count per key** (``apply_to_key_counts``; Dynamo's KV router #8012, llm-d #680):
  a store adds one, a remove takes one away, a key is present while its count is
  positive. Stores and removes must balance: a remove of a key never stored is an error,
  and a key stored twice stays present after one remove (vLLM's ``full`` report mode
  re-stores reused blocks without removing them: such keys never leave).
- **a radix tree** (``apply_to_key_tree``; Dynamo's indexer and ``RadixTree``): the set
  model, except that a store whose parent the tree lacks is dropped for good, and a
  remove takes the key's descendants along. It asks more of a producer than presence
  (every store's parent held), which no stream can give when the caches hold a key
  without its parent (``docs/design.md``); what is demanded of a producer is that a store
  never come before a parent the step leaves present.
A stream of presence transitions (stored on 0 -> 1, removed on 1 -> 0) satisfies the
first two: ``check_stream`` demands that, after every step, both models replayed over the
stream hold exactly the keys of the spec's state (``check_stream_step`` for one step, as
lockstep and the bounded walk need it).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from spec.block_hash import compute_external_hash, iter_block_hashes
from spec.event_stream import (
    MEDIUM_GPU,
    EventBatch,
    KeyStored,
    PresentKey,
    StreamError,
    StreamEvent,
    StreamKey,
    compute_key_stored,
    compute_stream_key,
    get_present_keys,
)
from spec.events import AllBlocksCleared
from spec.frozen_map import FrozenMap
from spec.state import AllocatorState


def apply_to_key_set(keys: frozenset[StreamKey], event: StreamEvent) -> frozenset[StreamKey]:
    """The set model: the keys present after ``event``."""
    if isinstance(event, AllBlocksCleared):
        return frozenset()
    stream_key = StreamKey(event.group, event.medium, event.block_hash)
    if isinstance(event, KeyStored):
        return keys | {stream_key}
    return keys - {stream_key}


def apply_to_key_counts(
    counts: FrozenMap[StreamKey, int], event: StreamEvent
) -> FrozenMap[StreamKey, int]:
    """The count model: each key's count after ``event`` (absent: 0). ``StreamError`` for a
    remove of a key whose count is 0: stores and removes do not balance."""
    if isinstance(event, AllBlocksCleared):
        return FrozenMap()
    stream_key = StreamKey(event.group, event.medium, event.block_hash)
    count = counts.get(stream_key, 0)
    if isinstance(event, KeyStored):
        return counts.set(stream_key, count + 1)
    if count == 0:
        message = f"KeyRemoved of {_describe(stream_key)}, which has no store left"
        raise StreamError(message, "unstored")
    return counts.delete(stream_key) if count == 1 else counts.set(stream_key, count - 1)


def apply_to_key_tree(
    tree: FrozenMap[StreamKey, StreamKey | None], event: StreamEvent
) -> FrozenMap[StreamKey, StreamKey | None]:
    """What a radix-tree consumer holds after ``event`` (each key with its parent): the set
    model, except that a store whose parent the tree lacks is dropped (Dynamo's indexer
    1.6.1: "Failed to find parent block; skipping store operation"), and a remove takes
    the key's descendants with it. So a tree consumer holds the set model's keys only
    while no store named an absent parent."""
    if isinstance(event, AllBlocksCleared):
        return FrozenMap()
    stream_key = StreamKey(event.group, event.medium, event.block_hash)
    if isinstance(event, KeyStored):
        parent = event.parent_block_hash
        parent_key = None if parent is None else StreamKey(event.group, event.medium, parent)
        if stream_key in tree or (parent_key is not None and parent_key not in tree):
            return tree
        return tree.set(stream_key, parent_key)
    gone = {stream_key} & tree.keys()
    while True:
        children = {key for key, parent in tree.items() if parent in gone} - gone
        if not children:
            return FrozenMap({key: parent for key, parent in tree.items() if key not in gone})
        gone |= children


def get_counted_keys(counts: FrozenMap[StreamKey, int]) -> frozenset[StreamKey]:
    """The keys the count model holds present."""
    return frozenset(key for key, count in counts.items() if count > 0)


def _describe(stream_key: StreamKey) -> str:
    return f"hash {stream_key.block_hash:#018x} (group {stream_key.group}, {stream_key.medium})"


def compute_prefix_score(
    keys: frozenset[StreamKey],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    group: int = 0,
) -> int:
    """What a router scores a prompt with against ``keys``: the tokens of its longest
    prefix of full blocks whose keys are all present on the device (``"GPU"``) in
    ``group``. Unlike the allocator's hit (``spec.caching.cached_prefix_tokens``) it may
    cover the whole prompt: the router does not compute the last token."""
    score = 0
    for block_hash in iter_block_hashes(tuple(token_ids), block_size, cache_salt):
        if StreamKey(group, MEDIUM_GPU, compute_external_hash(block_hash)) not in keys:
            break
        score += block_size
    return score


def is_gap(last_seq: int | None, batch: EventBatch) -> bool:
    """Whether ``batch`` does not follow the batch numbered ``last_seq`` (``None``: none
    received yet, so nothing is missing)."""
    return last_seq is not None and batch.seq != last_seq + 1


def replay_batches(buffer: Sequence[EventBatch], start_seq: int) -> tuple[EventBatch, ...] | None:
    """What a producer's replay buffer (its last batches, in order) answers a consumer
    asking for every batch from ``start_seq`` on; ``None`` when the buffer no longer
    holds ``start_seq`` (the consumer must then drop what it knows and wait for a
    resync). Nothing is missing when ``start_seq`` is past the newest batch."""
    if not buffer or start_seq > buffer[-1].seq:
        return ()
    if start_seq < buffer[0].seq:
        return None
    return tuple(batch for batch in buffer if batch.seq >= start_seq)


# -- the checker ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamStep:
    """What one step of a producer owes its consumers: the keys present after it, and
    whether it reset the prefix cache."""

    keys: frozenset[PresentKey]
    reset: bool


def get_stream_step(state: AllocatorState) -> StreamStep:
    """The step that left ``state``, read before ``take_events``: its present keys, and
    whether its events include the reset's ``AllBlocksCleared``."""
    reset = any(isinstance(event, AllBlocksCleared) for event in state.events)
    return StreamStep(get_present_keys(state), reset)


@dataclass(frozen=True, slots=True)
class StreamView:
    """What the checker keeps between steps: the set model's keys, the count model's
    counts, and the last batch number seen (``None``: none yet)."""

    keys: frozenset[StreamKey]
    counts: FrozenMap[StreamKey, int]
    last_seq: int | None = None


def start_stream_view(initial: frozenset[PresentKey], block_size: int) -> StreamView:
    """A consumer that knows the keys ``initial`` already (each counted once)."""
    keys = frozenset(_expected(initial, block_size))
    return StreamView(keys, FrozenMap(dict.fromkeys(keys, 1)))


def check_stream_step(
    view: StreamView,
    step: StreamStep,
    batches: Sequence[EventBatch],
    block_size: int,
    where: str = "step",
) -> StreamView:
    """The view after ``batches``, the batches one step published; ``StreamError``
    (its message starting with ``where``) unless they are a correct stream of ``step``:
    batch numbers follow each other without a gap; a step that reset the cache published
    an ``AllBlocksCleared``; every store names its key as the hash rule says, a key not
    present at that point, and a parent present at that point unless the step leaves the
    key without it; and after them, the set model and the count model each hold exactly
    the step's keys."""
    expected = _expected(step.keys, block_size)
    events = [event for batch in batches for event in batch.events]
    last_seq = view.last_seq
    for batch in batches:
        if is_gap(last_seq, batch):
            raise StreamError(f"{where}: batch {batch.seq} follows batch {last_seq}", "seq")
        last_seq = batch.seq
    if step.reset and not any(isinstance(event, AllBlocksCleared) for event in events):
        message = f"{where} reset the prefix cache but published no AllBlocksCleared"
        raise StreamError(message, "clear")
    keys, counts = view.keys, view.counts
    for event in events:
        _check_named(event, expected, block_size, where)
        _check_absent(event, keys, where)
        _check_parent(event, keys, expected, where)
        keys = apply_to_key_set(keys, event)
        try:
            counts = apply_to_key_counts(counts, event)
        except StreamError as error:
            raise StreamError(f"{where}: count model: {error}", error.rule) from None
    _check_view("set model", keys, expected, where)
    _check_view("count model", get_counted_keys(counts), expected, where)
    return StreamView(keys, counts, last_seq)


def check_stream(
    steps: Sequence[StreamStep],
    published: Sequence[Sequence[EventBatch]],
    block_size: int,
    initial: frozenset[PresentKey] = frozenset(),
) -> None:
    """``check_stream_step`` of each step in turn, from a consumer that knows ``initial``:
    ``StreamError`` at the first step after which ``published`` (the batches each step
    published, in order) is not a correct stream of ``steps``."""
    if len(published) != len(steps):
        raise ValueError(f"{len(steps)} steps but batches for {len(published)}")
    view = start_stream_view(initial, block_size)
    for index, (step, batches) in enumerate(zip(steps, published, strict=True)):
        view = check_stream_step(view, step, batches, block_size, f"step {index}")


def check_stream_of_states(
    states: Sequence[AllocatorState], published: Sequence[Sequence[EventBatch]]
) -> None:
    """``check_stream`` of the steps that led from ``states[0]`` through the others (each
    read before ``take_events``); ``published[i]`` are the batches of the step that left
    ``states[i + 1]``."""
    if not states:
        raise ValueError("no states: need at least the one the stream starts from")
    steps = [get_stream_step(state) for state in states[1:]]
    check_stream(steps, published, states[0].block_size, get_present_keys(states[0]))


def _expected(keys: frozenset[PresentKey], block_size: int) -> dict[StreamKey, PresentKey]:
    return {compute_stream_key(present, block_size): present for present in keys}


def _check_named(
    event: StreamEvent, expected: dict[StreamKey, PresentKey], block_size: int, where: str
) -> None:
    """A store of a key present after the step must name it as the hash rule does."""
    if not isinstance(event, KeyStored):
        return
    present = expected.get(StreamKey(event.group, event.medium, event.block_hash))
    if present is None:
        return  # stored then removed within the step, or a stray the views will report
    wanted = compute_key_stored(present, block_size)
    if event != wanted:
        message = f"{where}: {event} names its key wrongly; the hash rule gives {wanted}"
        raise StreamError(message, "key")


def _check_absent(event: StreamEvent, keys: frozenset[StreamKey], where: str) -> None:
    """A store says a key became present: not one present already (a count consumer would
    count it twice and keep it after its one remove)."""
    if not isinstance(event, KeyStored):
        return
    stream_key = StreamKey(event.group, event.medium, event.block_hash)
    if stream_key in keys:
        message = f"{where}: a store of {_describe(stream_key)}, present already"
        raise StreamError(message, "stored_twice")


def _check_parent(
    event: StreamEvent,
    keys: frozenset[StreamKey],
    expected: dict[StreamKey, PresentKey],
    where: str,
) -> None:
    """A store names a parent present at that point of the stream, unless the step leaves
    the key without its parent in the caches (a reset with requests running, a sliding
    window, a key refused as a duplicate: ``docs/design.md``). So a tree consumer, which
    drops a store whose parent it lacks, loses only what the caches themselves hold
    without its parent, never a key the stream sent out of order."""
    if not isinstance(event, KeyStored) or event.parent_block_hash is None:
        return
    parent = StreamKey(event.group, event.medium, event.parent_block_hash)
    if parent not in keys and parent in expected:
        child = StreamKey(event.group, event.medium, event.block_hash)
        raise StreamError(
            f"{where}: a store of {_describe(child)} before its parent "
            f"{_describe(parent)}, which the step leaves present",
            "parent_order",
        )


def _check_view(
    model: str, view: frozenset[StreamKey], expected: dict[StreamKey, PresentKey], where: str
) -> None:
    extra = sorted(view - expected.keys())
    missing = sorted(expected.keys() - view)
    if extra or missing:
        raise StreamError(
            f"{where}: the {model} holds {len(extra)} key(s) the spec's caches do not "
            f"({', '.join(map(_describe, extra[:3])) or '-'}) and lacks {len(missing)} they "
            f"hold ({', '.join(map(_describe, missing[:3])) or '-'})",
            "extra" if extra else "missing",
        )
