"""The model-vs-target state machine: spec (``self.model``) and impl (``self.target``) in lockstep.

Every row of ``spec.api.OPERATIONS`` is a rule (``operation_rule``): it draws each argument
by its kind (``ARGUMENTS``: valid and malformed alike), applies the operation to both by
name, and compares the return value or the raised error (type and message). The other
rules are the engine's sequences of those operations (a decode to a block boundary, a
speculation rolled back, a chunked prefill, a preemption and its recompute, forks written
to on both sides). After every step the invariants compare the whole states and run both
invariant checks; a run ends by releasing everything and asserting that the pool is full
again. impl's KV cache events go to a list: after every step they must be exactly the
spec's for that step (none for a refused one), and replaying every event from the start
must give exactly the blocks the spec's caches hold (``spec.replay_events``).

``machine_for(cls)`` builds the machine against any ``KVCacheManager`` subclass, which is
how the planted-bug tests point it at broken allocators. ``WindowedAllocatorMachine`` is
the same machine on pools with KV cache groups and small sliding windows (windows below,
at and not a multiple of the block size, a full group beside a windowed one); it also
checks the window rule after every operation that adds tokens
(``spec.invariants.is_window_tight``).
"""

import sys
from collections.abc import Callable
from typing import TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import spec
from impl import AppendedSlots, KVCacheManager
from impl.checking import check_indexes
from impl.event_publisher import EventPublisher
from impl.spec_backed import as_impl
from spec import AllocatorState, CachedBlock, KVCacheEvent
from spec.api import OPERATIONS, Argument, Operation
from spec.event_stream import StreamError
from spec.invariants import is_state_hit_exact, is_window_tight
from tests.support.stream_check import SpecPublisher, StreamChecker

T = TypeVar("T")

# A handful of ids, so duplicates and unknown ids come up often.
REQUEST_IDS = st.sampled_from(["r0", "r1", "r2", "r3", "r4"])
# Arbitrary counts, a few negative ones among them.
TOKEN_COUNTS = st.integers(min_value=-2, max_value=40)
# Prompts from a 4-token vocabulary, most starting with one of a few shared prefixes, so
# prefix hits, duplicate full blocks and hash collisions are all frequent.
SHARED_PREFIXES = [(), (1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 2, 3, 0, 0, 1), (2,) * 6]
TOKEN_IDS = st.lists(st.integers(0, 3), max_size=6).map(tuple)
PROMPTS = st.builds(
    lambda prefix, suffix: prefix + suffix, st.sampled_from(SHARED_PREFIXES), TOKEN_IDS
)


# Malformed arguments, drawn now and then among the well-formed: every one must be refused
# by spec and impl alike, with the same error, and change nothing.
BAD_COUNTS = st.sampled_from([True, False, 1.0, 2.5, float("nan"), "3", None])
BAD_TOKEN_IDS = st.sampled_from([-1, 2**32, True, 4.0, "a", None, (4,), [5]])
BAD_REQUEST_IDS = st.sampled_from([float("nan"), None, 7, b"r0"])
COUNTS = st.one_of(TOKEN_COUNTS, BAD_COUNTS)
ANY_TOKEN_ID = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), BAD_TOKEN_IDS)
ANY_TOKEN_IDS = st.one_of(
    TOKEN_IDS,
    st.lists(ANY_TOKEN_ID, min_size=1, max_size=6).map(tuple),
)
# What the spec does not take as token ids, or takes though they look odd: non-iterables,
# iterables that are not sequences (a set, a dict, text), and sequences of ints that are
# not tuples. Whatever a call makes of them, spec and impl must make the same.
ODD_VALUES: tuple[object, ...] = (
    None,
    2.5,
    {1: 2},
    {3, 1},
    frozenset(),
    "abc",
    b"\x01\x02",
    bytearray(b"\x01"),
    range(3),
    [1, 2],
)
ODD_TOKENS: st.SearchStrategy[object] = st.sampled_from(ODD_VALUES)
ANY_PROMPTS = st.one_of(PROMPTS, PROMPTS, ANY_TOKEN_IDS, ODD_TOKENS)
NEW_REQUEST_IDS = st.one_of(REQUEST_IDS, REQUEST_IDS, REQUEST_IDS, BAD_REQUEST_IDS)
# Cache salts: no salt, two tenants, the empty salt (a namespace apart from no salt), a
# lone surrogate (a JSON request's "\ud800"), and now and then one of the wrong type.
SALTS = st.sampled_from([None, "a", "b", "", "\ud800"])
ANY_SALTS = st.one_of(SALTS, SALTS, SALTS, st.sampled_from([7, b"a", ("a",)]))

# What each kind of argument of ``spec.api`` is drawn from, valid and malformed alike.
ARGUMENTS: dict[Argument, st.SearchStrategy[object]] = {
    Argument.REQUEST_ID: NEW_REQUEST_IDS,
    Argument.CHILD_ID: NEW_REQUEST_IDS,
    Argument.TOKENS: st.one_of(COUNTS, ANY_PROMPTS, ODD_TOKENS),
    Argument.TOKEN_COUNT: st.one_of(st.integers(-1, 40), BAD_COUNTS),
    Argument.CACHE_SALT: ANY_SALTS,
    Argument.PROMPT: ANY_PROMPTS,
}

# The errors an operation may be refused with; anything else fails the test.
REFUSALS = (TypeError, ValueError, KeyError, RuntimeError)


def _outcome(call: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return call(), None
    except REFUSALS as error:
        return None, error


class AllocatorMachine(RuleBasedStateMachine):
    """Drives ``spec`` and one ``KVCacheManager`` class with the same operations."""

    target_class: type[KVCacheManager] = KVCacheManager
    publisher_class: type[EventPublisher] = EventPublisher

    def __init__(self) -> None:
        super().__init__()
        self.model: AllocatorState = spec.init(1, 1)
        # The events impl emitted since the last step, and the view replaying all gives.
        self.events: list[KVCacheEvent] = []
        self.view: frozenset[CachedBlock] = frozenset()
        # The same events and the host prefix cache's, (on the host, event), in order:
        # what impl's publisher is fed; made with the spec's publisher on the first step.
        self.emitted: list[tuple[bool, KVCacheEvent]] = []
        self.streams: tuple[EventPublisher, SpecPublisher, StreamChecker, StreamChecker] | None
        self.streams = None
        self.streams_failed = False
        self.target: KVCacheManager = self.target_class(1, 1, event_sink=self.record)

    def record(self, event: KVCacheEvent) -> None:
        """impl's event sink."""
        self.events.append(event)
        self.emitted.append((False, event))

    def record_host(self, event: KVCacheEvent) -> None:
        """impl's host event sink (its host prefix cache's events)."""
        self.emitted.append((True, event))

    @initialize(total_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def init_pool(self, total_blocks: int, block_size: int) -> None:
        self.model = spec.init(total_blocks, block_size)
        self.target = self.target_class(total_blocks, block_size, event_sink=self.record)

    def _step(self, name: str, *args: object) -> object:
        """Call ``name`` on both (spec through ``spec.api.OPERATIONS``); assert they agree
        on the result, or on the error's type and message. Returns impl's result."""
        before = self.model
        transition = OPERATIONS[name].transition
        expected, expected_error = _outcome(lambda: transition(before, *args))
        actual, actual_error = _outcome(lambda: getattr(self.target, name)(*args))
        if expected_error is not None or actual_error is not None:
            assert type(actual_error) is type(expected_error), (
                f"{name}{args}: spec raised {expected_error!r}, impl {actual_error!r}"
            )
            assert str(actual_error) == str(expected_error), (
                f"{name}{args}: messages differ: {expected_error} / {actual_error}"
            )
            assert self.emitted == [], (
                f"{name}{args}: refused, but impl emitted events {self.emitted}"
            )
            return None
        assert expected is not None
        self.model, result = expected
        assert actual == as_impl(result), f"{name}{args}: spec gave {result!r}, impl {actual!r}"
        self._check_events(f"{name}{args}")
        return actual

    def _check_events(self, step: str) -> None:
        """Both streams of the step are correct (``_check_streams``), impl's events of the
        step are the spec's, and replaying every event so far gives the spec's caches; then
        the spec's are drained."""
        if self._check_streams(step):
            return
        assert self.events == list(self.model.events), (
            f"{step}: spec emitted events {list(self.model.events)}, impl {self.events}"
        )
        try:
            self.view = spec.replay_events(self.events, self.view)
        except spec.EventReplayError as error:
            raise AssertionError(f"{step}: impl's events do not replay: {error}") from error
        assert self.view == spec.get_cached_blocks(self.model), (
            f"{step}: replaying every event gives {sorted(self.view)}, "
            f"the caches hold {sorted(spec.get_cached_blocks(self.model))}"
        )
        self.events.clear()
        self.model = spec.take_events(self.model)

    def _check_streams(self, step: str) -> bool:
        """What a publisher sends of the spec's events and what impl's ``EventPublisher``
        sends of impl's are correct streams of the step, under both consumer models. Once
        a stream failed, the run is over: the teardown's steps check no events (returns
        True, having drained them)."""
        if self.streams_failed:
            self.emitted.clear()
            self.events.clear()
            self.model = spec.take_events(self.model)
            return True
        if self.streams is None:
            block_size = self.model.block_size
            self.streams = (
                self.publisher_class(block_size),
                SpecPublisher(block_size),
                StreamChecker(block_size),
                StreamChecker(block_size),
            )
        publisher, spec_publisher, spec_stream, impl_stream = self.streams
        for on_host, event in self.emitted:
            (publisher.record_host if on_host else publisher.record)(event)
        self.emitted.clear()
        try:
            spec_stream.check(self.model, spec_publisher.publish(self.model), f"{step}: spec")
            impl_stream.check(self.model, publisher.end_step(), f"{step}: impl")
        except (StreamError, spec.EventReplayError) as error:
            self.streams_failed = True
            raise AssertionError(f"KV event stream: {error}") from None
        return False

    def _add_tokens(self, request_id: str, count: int, data: st.DataObject) -> object:
        """``append`` of ``count`` tokens of the kind the request takes: token ids drawn
        from the small vocabulary if it tracks them, else the count."""
        if request_id in self.model.token_ids:
            ids = tuple(data.draw(st.integers(0, 3)) for _ in range(count))
            return self._step("append", request_id, ids)
        return self._step("append", request_id, count)

    # -- the engine's sequences of operations -------------------------------------------

    @rule(request_id=REQUEST_IDS, blocks=st.integers(0, 6), delta=st.sampled_from([-1, 0, 1]))
    def allocate_at_block_boundary(self, request_id: str, blocks: int, delta: int) -> None:
        self._step("allocate", request_id, blocks * self.model.block_size + delta)

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data(), count=st.integers(0, 12))
    def append_to_a_running_request(self, data: st.DataObject, count: int) -> None:
        """An append of the right kind to a request that holds blocks."""
        self._add_tokens(data.draw(st.sampled_from(sorted(self.model.tables))), count, data)

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data())
    def speculate_and_roll_back(self, data: st.DataObject) -> None:
        """Speculative decoding: append k draft tokens, cut the rejected ones, append the
        bonus token."""
        self._speculate(data, data.draw(st.sampled_from(sorted(self.model.tables))))

    @precondition(lambda self: 0 < len(self.model.tables) < 5)
    @rule(data=st.data())
    def fork_then_speculate(self, data: st.DataObject) -> None:
        """Parallel sampling with speculation: a rollback into blocks a fork still shares."""
        parent_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        child_id = data.draw(REQUEST_IDS.filter(lambda r: r not in self.model.tables))
        self._step("fork", parent_id, child_id)
        self._speculate(data, data.draw(st.sampled_from([parent_id, child_id])))

    def _speculate(self, data: st.DataObject, request_id: str) -> None:
        if request_id not in self.model.tables:
            return  # a refused fork (the child id is swapped out, in the host-tier machine)
        before = self.model.tables[request_id].token_count
        drafts = data.draw(st.integers(1, 2 * self.model.block_size + 1))
        if self._add_tokens(request_id, drafts, data) is None:
            return
        self._step("truncate", request_id, before + data.draw(st.integers(0, drafts)))
        self._add_tokens(request_id, 1, data)

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data())
    def decode_a_running_request_to_its_next_boundary(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        remaining = -self.model.tables[request_id].token_count % self.model.block_size
        for _ in range(remaining + 1):
            self._add_tokens(request_id, 1, data)

    @precondition(lambda self: 0 < len(self.model.tables) < 5)
    @rule(data=st.data())
    def fork_a_running_request_and_write_to_both(self, data: st.DataObject) -> None:
        """Parallel sampling: fork, then each side appends into what they share."""
        parent_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        child_id = data.draw(REQUEST_IDS.filter(lambda r: r not in self.model.tables))
        self._step("fork", parent_id, child_id)
        for request_id in data.draw(st.permutations([parent_id, child_id])):
            if request_id in self.model.tables:
                self._add_tokens(request_id, 1, data)

    @precondition(lambda self: len(self.model.token_ids) > 0)
    @rule(data=st.data())
    def preempt_and_recompute(self, data: st.DataObject) -> None:
        """The engine's preemption: release, then readmit with prompt and generated tokens."""
        request_id = data.draw(st.sampled_from(sorted(self.model.token_ids)))
        token_ids = self.model.token_ids[request_id]
        cache_salt = self.model.cache_salts.get(request_id)
        self._step("preempt", request_id)
        self._step("allocate", request_id, token_ids, cache_salt)

    @precondition(lambda self: len(self.model.token_ids) > 0)
    @rule(data=st.data())
    def cached_prefix_tokens_of_a_held_prompt(self, data: st.DataObject) -> None:
        """The query a second submission of a running prompt makes: a held request's
        tokens cut at a block boundary, under its salt, so every full block of it is
        cached (and the hit must still leave the last token out)."""
        request_id = data.draw(st.sampled_from(sorted(self.model.token_ids)))
        token_ids = self.model.token_ids[request_id]
        block_size = self.model.block_size
        cut = block_size * data.draw(st.integers(0, len(token_ids) // block_size))
        salt = self.model.cache_salts.get(request_id)
        self._step("cached_prefix_tokens", token_ids[:cut], salt)

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data())
    def roll_back_drafts_and_report_the_blocks(self, data: st.DataObject) -> None:
        """The engine's rollback: a token and its drafts in one append, then ``truncate``
        back to the kept ones (draft-filled blocks are cached)."""
        request_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        before = self.model.tables[request_id].token_count
        drafts = data.draw(st.integers(1, 2 * self.model.block_size + 1))
        if self._add_tokens(request_id, drafts, data) is not None:
            kept = before + data.draw(st.integers(0, drafts))
            self._step("truncate", request_id, kept)

    @precondition(lambda self: 0 < len(self.model.tables) < 5)
    @rule(data=st.data())
    def fork_then_roll_back_into_the_shared_blocks(self, data: st.DataObject) -> None:
        """A rollback of a request whose kept last block a fork still holds: its slots are
        the fork's K/V too, so none of them is stale."""
        parent_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        child_id = data.draw(REQUEST_IDS.filter(lambda r: r not in self.model.tables))
        self._step("fork", parent_id, child_id)
        held = self.model.tables[child_id].token_count if child_id in self.model.tables else 0
        self._step("truncate", parent_id, data.draw(st.integers(0, held)))

    @rule(request_id=REQUEST_IDS, token_ids=PROMPTS, cache_salt=SALTS, data=st.data())
    def prefill_in_chunks(
        self,
        request_id: str,
        token_ids: tuple[int, ...],
        cache_salt: str | None,
        data: st.DataObject,
    ) -> None:
        """The engine's chunked prefill: the hit over the whole prompt, the first chunk with
        ``allocate`` (its slots past the hit), each later chunk with one ``append``; chunk
        boundaries anywhere in a block. A hit of the cut prompt is the whole prompt's."""
        if not token_ids or request_id in self.model.tables:
            return
        done = self._step("cached_prefix_tokens", token_ids, cache_salt)
        assert isinstance(done, int)
        chunk = data.draw(st.integers(1, 7))
        allocated = self._step("allocate", request_id, token_ids[: done + chunk], cache_salt)
        if allocated is None:
            return  # refused (out of blocks): nothing changed
        assert isinstance(allocated, AppendedSlots) and allocated.cached_tokens == done
        done += chunk
        while done < len(token_ids):
            chunk = data.draw(st.integers(1, 7))
            if self._step("append", request_id, token_ids[done : done + chunk]) is None:
                return
            done += chunk

    @invariant()
    def states_agree(self) -> None:
        assert self.target.to_spec() == self.model
        assert self.target.usage() == spec.usage(self.model)

    @invariant()
    def invariants_hold(self) -> None:
        broken = spec.violated_invariants(self.model)
        assert broken == [], f"the spec state breaks {broken}"
        # ``states_agree`` showed ``to_spec()`` equal to the model: only the index is left.
        check_indexes(self.target)

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            # NOTE: the case has failed already. Releasing on the broken state would raise a
            # second error, chained to the first, which Hypothesis counts as another distinct
            # failure and shrinks as well: a planted leak took 10-65 s to shrink here, 4
            # cases to find.
            return
        for request_id in sorted(self.model.host.swapped) + sorted(self.model.tables):
            self._step("release", request_id)
        # Releasing demotes cached blocks: they are in flight until the copies are taken.
        self._step("take_transfers")
        # The check run after every step: a wrong state these releases leave is then the same
        # failure (one origin, one shrink) as the one a release rule leaves.
        self.states_agree()
        usage = self.target.usage()
        assert usage.free_blocks == usage.total_blocks, "a block leaked"
        assert usage.host_free_blocks == usage.host_blocks, "a host block leaked"
        state = self.target.to_spec()
        free = state.free_block_ids + state.cached_free_block_ids
        assert sorted(free) == list(range(state.total_blocks))
        assert not state.ref_counts, f"blocks still referenced: {dict(state.ref_counts)}"


def operation_rule(operation: Operation) -> Callable[[AllocatorMachine, tuple[object, ...]], None]:
    """The rule of one row of ``spec.api.OPERATIONS``: its arguments drawn by kind."""

    def apply(self: AllocatorMachine, args: tuple[object, ...]) -> None:
        self._step(operation.name, *args)

    apply.__name__ = apply.__qualname__ = operation.name
    arguments = st.tuples(*(ARGUMENTS[argument] for argument in operation.arguments))
    return rule(args=arguments)(apply)


for _operation in OPERATIONS.values():
    setattr(AllocatorMachine, _operation.name, operation_rule(_operation))


# KV cache groups for the windowed machine: one windowed group (Mistral-like) with windows
# of 1, 2, 3 and 5 tokens against blocks of 1..5 (so at, below, above and not a multiple
# of the block size), a full and a windowed group (Gemma-like) in both orders, and three.
GROUP_WINDOWS = st.sampled_from([(1,), (2,), (3,), (5,), (None, 2), (3, None), (None, 1, 4)])


class WindowedAllocatorMachine(AllocatorMachine):
    """``AllocatorMachine`` on pools shared by KV cache groups with sliding windows."""

    @initialize(
        total_blocks=st.integers(1, 12),
        block_size=st.integers(1, 5),
        group_windows=GROUP_WINDOWS,
    )
    def init_pool(
        self, total_blocks: int, block_size: int, group_windows: tuple[spec.GroupEntry, ...]
    ) -> None:
        self.model = spec.init(total_blocks, block_size, group_windows)
        self.target = self.target_class(
            total_blocks, block_size, group_windows=group_windows, event_sink=self.record
        )

    def _step(self, name: str, *args: object) -> object:
        """``AllocatorMachine._step``, then the window rule for an operation that added
        tokens: L0 is the length before an ``append``, the hit of an ``allocate``."""
        before = self.model
        result = super()._step(name, *args)
        if self.model is before or not isinstance(result, AppendedSlots):
            return result
        request_id = result.request_id
        computed_tokens = result.cached_tokens
        if name == "append":
            computed_tokens = before.tables[request_id].token_count
        assert is_window_tight(self.model, request_id, computed_tokens), (
            f"{name}{args}: a windowed table holds a block wholly outside its window"
        )
        return result


# Hybrid pools (``spec.kinds``): a full-attention group and a recurrent state group, the
# shape of LFM2 and Qwen3-Next, in both orders, with checkpoints every block and every
# other block; and a window beside a state group.


@st.composite
def hybrid_groups(draw: st.DrawFn) -> tuple[int, tuple[spec.GroupEntry, ...]]:
    """A block size and hybrid groups whose state interval is 1 or 2 blocks of it."""
    block_size = draw(st.integers(1, 3))
    state = spec.RecurrentState(block_size * draw(st.sampled_from([1, 2])))
    shape = draw(
        st.sampled_from([(None, state), (state, None), (2, state), (None, None, state), (state,)])
    )
    return block_size, shape


class HybridAllocatorMachine(WindowedAllocatorMachine):
    """``AllocatorMachine`` on hybrid pools: attention groups beside a state group. After
    every admission the state group's hit is checked against the caches it was found in
    (``spec.invariants.is_state_hit_exact``)."""

    @initialize(total_blocks=st.integers(1, 24), groups=hybrid_groups())
    def init_pool(  # the block size comes with the groups
        self, total_blocks: int, groups: tuple[int, tuple[spec.GroupEntry, ...]]
    ) -> None:
        block_size, group_windows = groups
        self.model = spec.init(total_blocks, block_size, group_windows)
        self.target = self.target_class(
            total_blocks, block_size, group_windows=group_windows, event_sink=self.record
        )

    @rule(
        request_id=REQUEST_IDS,
        sharer_id=REQUEST_IDS,
        token_ids=PROMPTS,
        suffix=TOKEN_IDS,
        data=st.data(),
    )
    def prefill_on_the_grid_then_share(
        self,
        request_id: str,
        sharer_id: str,
        token_ids: tuple[int, ...],
        suffix: tuple[int, ...],
        data: st.DataObject,
    ) -> None:
        """A hybrid engine's chunked prefill: every chunk ends on the state group's
        checkpoint grid, so the next chunk's append checkpoints it; then a second request
        shares a prefix of the prompt and adds its own tokens: its hit restores the
        checkpoint at exactly the common hit, or starts from no state."""
        interval = min(
            k.interval for k in self.model.group_windows if isinstance(k, spec.RecurrentState)
        )
        if not token_ids or request_id in self.model.tables:
            return
        done = min(interval, len(token_ids))
        if self._step("allocate", request_id, token_ids[:done]) is None:
            return
        while done < len(token_ids):
            chunk = token_ids[done : done + interval]
            if self._step("append", request_id, chunk) is None:
                return
            done += len(chunk)
        cut = data.draw(st.integers(0, len(token_ids)))
        if sharer_id not in self.model.tables:
            self._step("allocate", sharer_id, token_ids[:cut] + suffix)

    def _step(self, name: str, *args: object) -> object:
        before = self.model
        result = super()._step(name, *args)
        if name == "allocate" and isinstance(result, AppendedSlots):
            assert is_state_hit_exact(
                before, self.model, result.request_id, result.cached_tokens
            ), (
                f"{name}{args}: the state group's hit of {result.cached_tokens} tokens is not "
                "a copy of the checkpoint at exactly that length"
            )
        return result


def machine_for(
    target_class: type[KVCacheManager],
    machine: type[AllocatorMachine] = AllocatorMachine,
    publisher_class: type[EventPublisher] = EventPublisher,
) -> type[AllocatorMachine]:
    """The state machine ``machine`` driving ``target_class`` against the spec, its events
    published by ``publisher_class``."""
    return type(
        f"{machine.__name__}For{target_class.__name__}",
        (machine,),
        {"target_class": target_class, "publisher_class": publisher_class},
    )
