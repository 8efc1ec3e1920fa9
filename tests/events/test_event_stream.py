"""``spec.event_stream``: pagedkv's events as a router's stream, the two consumer models,
gaps and replay, and the checker, which catches each planted producer bug."""

from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from spec.block_hash import compute_external_hash, iter_block_hashes
from spec.event_consumers import (
    StreamStep,
    StreamView,
    apply_to_key_counts,
    apply_to_key_set,
    apply_to_key_tree,
    check_stream,
    check_stream_of_states,
    check_stream_step,
    compute_prefix_score,
    get_counted_keys,
    get_stream_step,
    is_gap,
    replay_batches,
    start_stream_view,
)
from spec.event_stream import (
    BlockKeys,
    EventBatch,
    KeyRemoved,
    KeyStored,
    PresentKey,
    StreamError,
    StreamEvent,
    StreamKey,
    compute_key_stored,
    compute_resync_events,
    compute_step_events,
    compute_stream_key,
    get_present_keys,
    translate_events,
)
from spec.events import AllBlocksCleared
from spec.frozen_map import FrozenMap
from spec.records import CacheKey
from tests.events.stream_runs import (
    BLOCK_SIZE,
    Op,
    Published,
    admit,
    extend,
    finish,
    numbered,
    operations,
    reset,
    run,
)

# A run with every kind of change: stores, a shared prefix, evictions, a reset, a salt.
SCENARIO = [
    admit("a", (1, 2, 3, 4, 5)),  # stores [1 2], [1 2 3 4]
    extend("a", (6,)),  # stores [1 2 3 4 5 6]
    admit("b", (1, 2, 3, 9)),  # hits [1 2], stores [1 2 3 9]
    finish("a"),
    finish("b"),
    admit("c", (7, 7, 7, 7, 7, 7, 7, 7, 7)),  # evicts cached blocks: removes
    finish("c"),
    reset,
    admit("d", (1, 2, 3), "tenant"),
]


def test_the_publisher_s_stream_of_a_run_is_correct_under_both_consumer_models() -> None:
    states, published = run(SCENARIO)
    check_stream_of_states(states, published)
    events = [e for batches in published for b in batches for e in b.events]
    assert sum(isinstance(e, KeyStored) for e in events) == 9
    assert sum(isinstance(e, KeyRemoved) for e in events) == 3
    assert [b.seq for batches in published for b in batches] == list(range(6))


def test_a_first_block_carries_its_salt_and_a_later_one_its_parent_s_hash() -> None:
    _, published = run([admit("a", (1, 2, 3, 4, 5), "tenant")])
    first, second = published[0][0].events
    assert isinstance(first, KeyStored) and isinstance(second, KeyStored)
    assert (first.parent_block_hash, first.token_ids, first.cache_salt) == (None, (1, 2), "tenant")
    assert (second.parent_block_hash, second.token_ids, second.cache_salt) == (
        first.block_hash,
        (3, 4),
        None,
    )
    unsalted = run([admit("a", (1, 2, 3))])[1][0][0].events[0]
    assert isinstance(unsalted, KeyStored) and unsalted.block_hash != first.block_hash


def test_events_translated_in_one_call_go_on_past_a_clear() -> None:
    """A publisher may translate several steps' events at once: what follows an
    ``AllBlocksCleared`` is translated too, as it is step by step."""
    states, published = run([admit("a", (1, 2, 3)), reset, admit("b", (4, 5, 6))])
    _, events = translate_events(BlockKeys(BLOCK_SIZE), states[2].events + states[3].events)
    assert events[0] == AllBlocksCleared() and len(events) == 2
    assert events == published[1][0].events + published[2][0].events


# -- planted producer bugs: each a small change to the publisher's batches ----------------


def events_of(published: Published) -> list[tuple[int, StreamEvent]]:
    return [(step, e) for step, batches in enumerate(published) for b in batches for e in b.events]


def adding(published: Published, step: int, *events: StreamEvent) -> Published:
    """``published`` with ``events`` added at the end of step ``step``'s batch."""
    out: Published = [list(batches) for batches in published]
    old = tuple(e for b in out[step] for e in b.events)
    out[step] = [EventBatch(0, (*old, *events))]
    return numbered(out)


def first(published: Published, kind: type[StreamEvent]) -> tuple[int, StreamEvent]:
    return next((s, e) for s, e in events_of(published) if isinstance(e, kind))


def stores_before_the_write(published: Published) -> Published:
    """vLLM #41838: a block's key published a step before its K/V is written (here: step
    1's store, of the block its appended token fills, sent with step 0's)."""
    early = published[1][0].events[0]
    return adding(published, 0, early)


def removes_while_a_copy_remains(published: Published) -> Published:
    """vLLM #55092: a store per copy and a remove per copy, so one copy's eviction removes
    a key another still holds (here: request b's hit of [1 2] counted as a second copy at
    step 2, and that copy's removal sent at step 3 while the key stays cached)."""
    _, stored = first(published, KeyStored)
    assert isinstance(stored, KeyStored)
    copied = adding(published, 2, stored)
    return adding(copied, 3, KeyRemoved(stored.group, stored.medium, stored.block_hash))


def re_stores_without_a_remove(published: Published) -> Published:
    """vLLM's ``full`` report mode (#45261): a reused block stored again and removed once,
    so a counting consumer keeps the key after its removal (here: step 2 re-stores the
    first key that step 5 evicts)."""
    _, removed = first(published, KeyRemoved)
    stored = next(
        e
        for _, e in events_of(published)
        if isinstance(e, KeyStored)
        and isinstance(removed, KeyRemoved)
        and e.block_hash == removed.block_hash
    )
    return adding(published, 2, stored)


def forgets_the_clear_on_reset(published: Published) -> Published:
    """TensorRT-LLM #17145's class: a reset that tells the consumers nothing."""
    step, _ = first(published, AllBlocksCleared)
    out: Published = [list(batches) for batches in published]
    out[step] = []
    return numbered(out)


def skips_a_sequence_number(published: Published) -> Published:
    """A batch numbered past the next number (from step 5 on, every batch's seq + 1)."""
    return [
        [EventBatch(b.seq + (step >= 5), b.events) for b in batches]
        for step, batches in enumerate(published)
    ]


@pytest.mark.parametrize(
    ("bug", "message"),
    [
        (stores_before_the_write, "step 0: the set model holds 1 key"),
        # Each copy's store is a store of a key present already: caught before the remove.
        (removes_while_a_copy_remains, "step 2: a store of hash"),
        (re_stores_without_a_remove, "step 2: a store of hash"),
        (
            forgets_the_clear_on_reset,
            "step 7 reset the prefix cache but published no AllBlocksCleared",
        ),
        (skips_a_sequence_number, "step 5: batch 4 follows batch 2"),
    ],
)
def test_the_checker_catches_each_planted_producer_bug(
    bug: Callable[[Published], Published], message: str
) -> None:
    states, published = run(SCENARIO)
    with pytest.raises(StreamError) as caught:
        check_stream_of_states(states, bug(published))
    assert message in str(caught.value)


def test_one_step_is_checked_from_any_state_s_keys_as_the_bounded_walk_needs() -> None:
    states, published = run(SCENARIO)
    view = start_stream_view(get_present_keys(states[5]), BLOCK_SIZE)
    after = check_stream_step(view, get_stream_step(states[6]), published[5], BLOCK_SIZE)
    assert after.last_seq == published[5][0].seq and len(after.keys) == 4 - 3 + 4
    with pytest.raises(StreamError, match=r"^step 5: the set model"):
        check_stream_step(view, get_stream_step(states[6]), [], BLOCK_SIZE, "step 5")


def test_a_run_s_stream_is_checked_from_the_keys_its_first_state_holds() -> None:
    states, published = run(SCENARIO)
    check_stream_of_states(states[5:], published[5:])  # step 5 evicts blocks held before
    steps = [get_stream_step(state) for state in states[6:]]
    with pytest.raises(StreamError, match=r"^step 0: "):
        check_stream(steps, published[5:], BLOCK_SIZE)  # a consumer that knew no key
    with pytest.raises(ValueError, match=r"^4 steps but batches for 3$"):
        check_stream(steps, published[5:-1], BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"^no states: need at least the one the stream starts"):
        check_stream_of_states([], [])


def test_a_view_that_differs_from_the_caches_is_reported_with_its_keys_and_rule() -> None:
    """The message names the model, how many keys it holds wrongly and which (the first
    three, by hash), and says ``-`` for none; the rule says which side is wrong."""
    gpu = [PresentKey(0, "GPU", CacheKey(None, (token, token))) for token in range(4)]
    hashes = sorted(compute_stream_key(present, 2).block_hash for present in gpu)
    named = ", ".join(f"hash {h:#018x} (group 0, GPU)" for h in hashes[:3])
    empty = start_stream_view(frozenset(), 2)
    strays = tuple(KeyStored(0, "GPU", h, None, (9, 9), None) for h in hashes)
    with pytest.raises(StreamError) as caught:
        check_stream_step(empty, StreamStep(frozenset(), False), [EventBatch(0, strays)], 2)
    assert str(caught.value) == (
        f"step: the set model holds 4 key(s) the spec's caches do not ({named}) "
        "and lacks 0 they hold (-)"
    )
    assert caught.value.rule == "extra"
    with pytest.raises(StreamError) as caught:
        check_stream_step(empty, StreamStep(frozenset(gpu), False), [], 2)
    assert str(caught.value) == (
        "step: the set model holds 0 key(s) the spec's caches do not (-) "
        f"and lacks 4 they hold ({named})"
    )
    assert caught.value.rule == "missing"
    # A view that counted a key twice keeps it after one remove: only the count model errs.
    key = StreamKey(0, "GPU", hashes[0])
    twice = StreamView(frozenset({key}), FrozenMap({key: 2}))
    removed = [EventBatch(0, (KeyRemoved(*key),))]
    with pytest.raises(StreamError, match=r"^step: the count model holds 1 key\(s\)"):
        check_stream_step(twice, StreamStep(frozenset(), False), removed, 2)


def test_a_reset_of_empty_caches_still_owes_its_clear() -> None:
    states, published = run([reset])
    check_stream_of_states(states, published)
    with pytest.raises(StreamError, match="step 0 reset the prefix cache"):
        check_stream_of_states(states, [[]])


def test_a_store_that_names_its_key_wrongly_is_caught() -> None:
    states, published = run([admit("a", (1, 2, 3))])
    stored = published[0][0].events[0]
    assert isinstance(stored, KeyStored)
    wrong = replace(stored, token_ids=(2, 1))
    with pytest.raises(StreamError, match="names its key wrongly"):
        check_stream_of_states(states, [[EventBatch(0, (wrong,))]])


# -- random runs ------------------------------------------------------------------------------


@given(st.lists(operations, max_size=25))
def test_the_publisher_s_stream_of_any_run_is_correct(
    ops: list[Op],
) -> None:
    states, published = run(ops)
    check_stream_of_states(states, published)


@given(st.lists(operations, max_size=25))
def test_the_canonical_events_of_each_step_are_a_correct_stream_too(
    ops: list[Op],
) -> None:
    states, _ = run(ops)
    published: Published = []
    for index, (before, after) in enumerate(pairwise(states)):
        step = compute_step_events(
            get_present_keys(before),
            get_present_keys(after),
            any(isinstance(e, AllBlocksCleared) for e in after.events),
            BLOCK_SIZE,
        )
        published.append([EventBatch(index, step)] if step else [])
    check_stream_of_states(states, numbered(published))


def test_a_step_s_events_come_in_one_order_whatever_the_set_s_order() -> None:
    """Parents before children (shorter prefixes first), and among equals a fixed order:
    group, medium, salted keys by salt before unsalted ones, tokens; removes the reverse.
    Seven keys of one prefix that differ only by salt: a tie would leave them in the
    frozenset's order, which string hashing varies from process to process."""
    salted = [PresentKey(0, "GPU", CacheKey(salt, (1, 2))) for salt in "abcdef"]
    order = [
        PresentKey(0, "CPU", CacheKey(None, (1, 2))),
        *salted,
        PresentKey(0, "GPU", CacheKey(None, (1, 2))),
        PresentKey(0, "GPU", CacheKey(None, (5, 6))),
        PresentKey(0, "GPU", CacheKey(None, (1, 2, 3, 4))),
        PresentKey(1, "GPU", CacheKey(None, (1, 2))),
    ]
    stores = tuple(compute_key_stored(present, 2) for present in order)
    removes = tuple(KeyRemoved(*compute_stream_key(present, 2)) for present in reversed(order))
    assert compute_step_events(frozenset(), frozenset(order), False, 2) == stores
    assert compute_step_events(frozenset(order), frozenset(), False, 2) == removes
    assert compute_resync_events(frozenset(order), 2) == (AllBlocksCleared(), *stores)


@given(st.lists(operations, max_size=25), st.data())
def test_a_consumer_that_misses_a_batch_recovers_by_replay_or_by_a_resync(
    ops: list[Op], data: st.DataObject
) -> None:
    states, published = run(ops)
    batches = [b for bs in published for b in bs]
    if not batches:
        return
    dropped = data.draw(st.integers(0, len(batches) - 1), label="dropped batch")
    buffer_size = data.draw(st.integers(1, len(batches)), label="replay buffer")
    expected = {compute_stream_key(p, BLOCK_SIZE) for p in get_present_keys(states[-1])}
    keys: frozenset[StreamKey] = frozenset()
    last: int | None = -1  # subscribed before the first batch: it expects batch 0
    for index, batch in enumerate(batches):
        if index == dropped:
            continue
        if is_gap(last, batch):
            assert last is not None
            missed = replay_batches(batches[max(0, index - buffer_size) : index], last + 1)
            note(f"gap before {batch.seq}: replay {'failed' if missed is None else 'served'}")
            if missed is None:
                # The consumer drops what it knows; the producer resyncs it.
                resync = compute_resync_events(get_present_keys(states[-1]), BLOCK_SIZE)
                keys = frozenset()
                for event in resync:
                    keys = apply_to_key_set(keys, event)
                assert keys == expected
                return
            for replayed in missed:
                for event in replayed.events:
                    keys = apply_to_key_set(keys, event)
        for event in batch.events:
            keys = apply_to_key_set(keys, event)
        last = batch.seq
    if dropped == len(batches) - 1:
        return  # nothing came after the lost batch to reveal the gap
    assert keys == expected


def test_the_count_model_refuses_a_remove_it_has_no_store_for() -> None:
    key = KeyRemoved(0, "GPU", 7)
    with pytest.raises(StreamError, match="has no store left") as caught:
        apply_to_key_counts(FrozenMap(), key)
    assert caught.value.rule == "unstored"
    counts = apply_to_key_counts(FrozenMap(), KeyStored(0, "GPU", 7, None, (1, 2), None))
    counts = apply_to_key_counts(counts, KeyStored(0, "GPU", 7, None, (1, 2), None))
    counts = apply_to_key_counts(counts, key)
    assert get_counted_keys(counts) == {(0, "GPU", 7)}
    # The second remove takes the key out of the map: a count of 0 kept would grow a
    # long-running consumer's map with every key it ever saw.
    assert apply_to_key_counts(counts, key) == FrozenMap()
    zero, two = StreamKey(0, "GPU", 7), StreamKey(0, "GPU", 8)
    assert get_counted_keys(FrozenMap({zero: 0, two: 2})) == {two}  # a count of 0 is absent


def test_replay_answers_what_the_buffer_holds_and_none_when_it_no_longer_does() -> None:
    buffer = [EventBatch(seq, ()) for seq in range(5, 9)]
    assert [b.seq for b in replay_batches(buffer, 7) or ()] == [7, 8]
    assert replay_batches(buffer, 5) == tuple(buffer) and replay_batches(buffer, 4) is None
    assert replay_batches([], 3) == ()
    assert replay_batches(buffer, 9) == ()
    assert not is_gap(None, buffer[0]) and is_gap(5, buffer[2]) and not is_gap(5, buffer[1])


def test_the_tree_model_drops_a_store_without_its_parent_and_a_remove_takes_a_subtree() -> None:
    def stored(block_hash: int, parent: int | None, group: int = 0) -> KeyStored:
        return KeyStored(group, "GPU", block_hash, parent, (block_hash,), None)

    tree: FrozenMap[StreamKey, StreamKey | None] = FrozenMap()
    for event in (stored(1, None), stored(2, 1), stored(3, 2), stored(4, 1), stored(5, 3)):
        tree = apply_to_key_tree(tree, event)
    key = {n: StreamKey(0, "GPU", n) for n in range(1, 6)}
    held = {key[1]: None, key[2]: key[1], key[3]: key[2], key[4]: key[1], key[5]: key[3]}
    assert dict(tree) == held
    # Dropped: a parent never stored; a parent held in another group; a key already held
    # (its first parent stays).
    for event in (stored(6, 9), stored(7, 1, group=1), stored(3, 4)):
        assert apply_to_key_tree(tree, event) == tree
    # A remove takes the key's subtree, however deep; a remove of an absent key, nothing.
    assert dict(apply_to_key_tree(tree, KeyRemoved(0, "GPU", 2))) == {key[1]: None, key[4]: key[1]}
    assert apply_to_key_tree(tree, KeyRemoved(1, "GPU", 2)) == tree
    assert apply_to_key_tree(tree, AllBlocksCleared()) == FrozenMap()


def test_a_router_scores_the_longest_prefix_of_full_blocks_it_holds_on_the_device() -> None:
    prompt = (1, 2, 3, 4, 5)
    first, second = (compute_external_hash(h) for h in iter_block_hashes(prompt, 2, None))
    salted = [compute_external_hash(h) for h in iter_block_hashes(prompt, 2, "t")]

    def held(*hashes: int, medium: str = "GPU", group: int = 0) -> frozenset[StreamKey]:
        return frozenset(StreamKey(group, medium, h) for h in hashes)

    prefixes = ((first, second), (first,), (second,))
    assert [compute_prefix_score(held(*hs), prompt, 2) for hs in prefixes] == [4, 2, 0]
    assert compute_prefix_score(held(first, second, medium="CPU"), prompt, 2) == 0
    assert compute_prefix_score(held(first, group=1), prompt, 2) == 0
    assert compute_prefix_score(held(first, group=1), prompt, 2, group=1) == 2
    assert compute_prefix_score(held(*salted), prompt, 2) == 0
    assert compute_prefix_score(held(*salted), prompt, 2, cache_salt="t") == 4
    # Every block of a prompt counts when all are full: a router computes no last token.
    assert compute_prefix_score(held(first, second), prompt[:4], 2) == 4
