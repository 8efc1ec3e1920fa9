"""The kit reads a target's KV cache events and judges them as a router would consume them.

A target that supports ``KV_EVENTS`` hands over, after each step, the events it emitted
(``take_events``) as ``TargetStored`` / ``TargetRemoved`` / ``AllBlocksCleared``: vLLM's
``KVEventBatch`` events in a neutral shape, a store naming several blocks (the hashes of a
chain, its tokens, the parent hash before the first) as vLLM's does. ``EventJudge`` splits
each store into one record per block, as a consumer does, and learns which prefix each of
the target's hashes names (the chain's tokens from the parent's prefix on, the salt from
the first block's extra keys); the target's hash function is its own (vLLM's default is
pickle-based), so each record is then named by the spec's hash rule and the step's
records are checked with ``spec.event_consumers.check_stream_step`` against the spec
state the kit sees the target in: both consumer models, the set and the count, must hold
exactly its cached keys, a store must not name a key present already, nor come before
its parent. A key the step removes last while the caches still hold it (a copy remains)
is ``missing`` before any of those rules is checked, so the finding is named by its
cause. A broken rule is a finding named ``events_<rule>`` (``StreamError.rule``);
the judge then resyncs its consumer to the step's keys, so every step is judged on its
own. transformers has no KV cache events: its adapters do not support ``KV_EVENTS``.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from harness.conformance.properties import Finding
from spec import AllBlocksCleared, AllocatorState, CacheKey
from spec.event_consumers import (
    StreamView,
    apply_to_key_counts,
    check_stream_step,
    get_stream_step,
    start_stream_view,
)
from spec.event_stream import (
    EventBatch,
    KeyRemoved,
    PresentKey,
    StreamError,
    StreamEvent,
    compute_key_stored,
    compute_stream_key,
    get_present_keys,
)
from spec.frozen_map import FrozenMap

# Each rule of spec.event_stream.StreamError, as the finding events_<rule> states it.
EVENT_RULES: Mapping[str, str] = MappingProxyType(
    {
        "events_extra": "a consumer of the events holds no key the caches do not",
        "events_missing": "a consumer of the events holds every key the caches hold",
        "events_stored_twice": "a key is stored only when it becomes present",
        "events_parent_order": "a block is stored after its parent, when the step keeps both",
        "events_unstored": "a remove names a hash a store named, still stored",
        "events_key": "a hash names one prefix",
        "events_seq": "batches are numbered one by one",
        "events_clear": "a reset sends AllBlocksCleared",
    }
)
# What a correct stream is, as a finding's "spec" side.
PRESENCE = (
    "a store when a key becomes present, a remove when its last copy goes "
    "(spec.event_consumers: both consumer models hold exactly the cached keys)"
)


@dataclass(frozen=True, slots=True)
class TargetStored:
    """Blocks ``block_hashes`` (a chain, in order) cached in ``group`` and ``medium``,
    holding ``token_ids`` (``block_size`` each) after the block hashed
    ``parent_block_hash``; ``cache_salt`` is the chain's first block's, if this is it."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None
    group: int
    medium: str


@dataclass(frozen=True, slots=True)
class TargetRemoved:
    """Blocks hashed ``block_hashes`` no longer cached in ``group`` and ``medium``."""

    block_hashes: tuple[int, ...]
    group: int
    medium: str


TargetEvent = TargetStored | TargetRemoved | AllBlocksCleared


class EventSource(Protocol):
    """An adapter that supports ``KV_EVENTS``."""

    def take_events(self) -> Sequence[TargetEvent]:
        """The events the target emitted since the last call, in order."""
        ...


class EventJudge:
    """The kit's consumer of one target's stream, step after step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (group, medium, target hash) -> the prefix it names, learned from the stores.
        self.prefixes: dict[tuple[int, str, int], CacheKey] = {}
        self.view: StreamView = start_stream_view(frozenset(), block_size)
        self.next_seq = 0

    def judge(
        self, events: Sequence[TargetEvent], state: AllocatorState, where: str
    ) -> list[Finding]:
        """The findings of one step's ``events``, the target now in ``state``."""
        records: tuple[StreamEvent, ...] = ()
        # Each key's last event in the step: stored (True) or removed (False).
        last: dict[PresentKey, bool] = {}
        removed: set[PresentKey] = set()  # every key the step removes, at any point
        try:
            records = tuple(
                record for event in events for record in self._split(event, last, removed, where)
            )
            batches = (EventBatch(self.next_seq, records),) if records else ()
            self.next_seq += len(batches)
            _check_no_remove_of_a_cached_key(last, state, where)
            step = get_stream_step(state)
            self.view = check_stream_step(self.view, step, batches, self.block_size, where)
        except StreamError as error:
            named = _named_by_its_cause(error, removed, state)
            self.view = self._resync(state, records)
            return [Finding(f"events_{named.rule}", str(named), PRESENCE)]
        return []

    def _resync(self, state: AllocatorState, records: Sequence[StreamEvent]) -> StreamView:
        """The consumer after a broken rule: the set model holds the keys the caches hold,
        and the count model keeps for each of them the count the target's own stores and
        removes give it (at least one).

        NOTE: not a count of one for every key: after a declared second store of a key
        (two cached copies, ``events_stored_twice``) a counting consumer rightly expects
        two removes, and a reset count of one made the second copy's remove
        ``events_unstored`` (vllm-hybrid, seed 7, in CI)."""
        counts = self.view.counts
        for record in records:
            try:
                counts = apply_to_key_counts(counts, record)
            except StreamError:  # a remove with no store left: a counting consumer skips it
                continue
        present = start_stream_view(get_present_keys(state), self.block_size).keys
        kept = FrozenMap({key: max(counts.get(key, 0), 1) for key in present})
        return StreamView(present, kept, self.next_seq - 1)

    def _split(
        self,
        event: TargetEvent,
        last: dict[PresentKey, bool],
        removed: set[PresentKey],
        where: str,
    ) -> list[StreamEvent]:
        """One record per block, named by the spec's hash rule, each key's event noted in
        ``last``; ``StreamError`` for a hash the stores so far do not name, or one that
        named another prefix."""
        if isinstance(event, AllBlocksCleared):
            last.clear()
            return [event]
        if isinstance(event, TargetRemoved):
            return [
                self._removed(event, block_hash, last, removed, where)
                for block_hash in event.block_hashes
            ]
        prefix: tuple[int, ...] = ()
        salt = event.cache_salt
        if event.parent_block_hash is not None:
            parent = self._prefix(event.group, event.medium, event.parent_block_hash, where)
            prefix, salt = parent.token_ids, parent.cache_salt
        records: list[StreamEvent] = []
        for index, block_hash in enumerate(event.block_hashes):
            start = index * self.block_size
            prefix += event.token_ids[start : start + self.block_size]
            key = CacheKey(salt, prefix)
            place = (event.group, event.medium, block_hash)
            if self.prefixes.setdefault(place, key) != key:
                raise StreamError(
                    f"{where}: hash {block_hash:#018x} names {key}, and {self.prefixes[place]} "
                    "before",
                    "key",
                )
            present = PresentKey(event.group, event.medium, key)
            last[present] = True
            records.append(compute_key_stored(present, self.block_size))
        return records

    def _removed(
        self,
        event: TargetRemoved,
        block_hash: int,
        last: dict[PresentKey, bool],
        removed: set[PresentKey],
        where: str,
    ) -> KeyRemoved:
        key = self._prefix(event.group, event.medium, block_hash, where)
        present = PresentKey(event.group, event.medium, key)
        last[present] = False
        removed.add(present)
        return KeyRemoved(*compute_stream_key(present, self.block_size))

    def _prefix(self, group: int, medium: str, block_hash: int, where: str) -> CacheKey:
        key = self.prefixes.get((group, medium, block_hash))
        if key is None:
            raise StreamError(f"{where}: hash {block_hash:#018x}, which no store named", "unstored")
        return key


def _named_by_its_cause(
    error: StreamError, removed: set[PresentKey], state: AllocatorState
) -> StreamError:
    """``error`` as ``missing`` when it is a child's store before its parent in a step that
    removed, and later stored again, a key the caches still hold at its end: the parent
    dropped by a remove while a copy stayed (the case ``_check_no_remove_of_a_cached_key``
    cannot see, the key's last event being its second store)."""
    if error.rule != "parent_order":
        return error
    present = get_present_keys(state)
    if not removed & present:
        return error
    return StreamError(f"{error} (a remove earlier in the step while a copy remained)", "missing")


def _check_no_remove_of_a_cached_key(
    last: dict[PresentKey, bool], state: AllocatorState, where: str
) -> None:
    """``StreamError`` (``missing``) for a key whose last event in the step is its remove
    while the caches still hold it: a remove while a copy remains. Checked before the
    stream's own rules, which would see it first as whatever the remove breaks next (a
    child's store naming the removed parent: ``parent_order``)."""
    present = get_present_keys(state)
    kept = [key for key, stored in last.items() if not stored and key in present]
    if kept:
        names = ", ".join(f"{key.key} (group {key.group}, {key.medium})" for key in kept)
        raise StreamError(
            f"{where}: removes {names} while the caches still hold it (a copy remains)",
            "missing",
        )
