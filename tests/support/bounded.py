"""Exhaustive bounded model checking: every reachable spec state of small pools, every operation.

For each pool shape (``total_blocks``, ``block_size``) it walks the spec breadth first from
``spec.init``, applying every operation with every argument in range, valid or not: each
request id (so unknown and duplicate ids come up), token counts from -1 to one past the
pool's capacity (so negative counts and exhaustion come up). States are deduplicated (they
are hashable). Token counts cannot outgrow the pool, so the reachable space is finite and
the walk ends on its own.

At every (state, operation) it checks that:
- the spec raises only the specified errors, and on success keeps every named invariant and
  leaves every other request's table as it was;
- the impl, rebuilt by replaying the shortest path from ``init`` to that state, gives the
  same result or the same error (type and message), ends in the same state with the same
  usage report and passes its own invariant check; a refused operation changes nothing.

KV cache events too: the spec's events of the transition replayed onto the view of the
state before (``spec.replay_events``) give exactly the caches after, so replaying every
event from ``init`` gives the caches of every reached state; impl's events (a list sink)
are exactly the spec's, and a refused operation emits none. And the stream a router
reads (``tests.support.stream_check``): what a publisher sends of the spec's events and
what impl's ``EventPublisher`` sends of impl's (the host prefix cache's too, medium
``"CPU"``) are each a correct stream of the transition, from a consumer that knows the
keys of the state before, under both consumer models.

With KV cache groups (``Bounds.group_windows``) it also takes skipped blocks, reads every
group's table, and after every operation that adds tokens checks the window rule
(``spec.invariants.is_window_tight``: the request's windowed tables skipped exactly the
blocks no query at or past L0 reads).

Breadth first means the first violation met is one with the shortest path from ``init``;
that path is the report. It is a tool for tests, not a prover: it covers only the bounds it
is given, and the impl only along the shortest path to each state.

Run ``python -m tests.support.bounded --max-blocks 3 --max-block-size 3`` (``--help`` for the rest).
"""

import argparse
import importlib
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product

import spec
from impl import KVCacheManager
from impl.checking import check_indexes
from impl.event_publisher import EventPublisher
from impl.spec_backed import as_impl
from spec import (
    AllocatorState,
    BlockAllocationError,
    HostCounters,
    KVCacheEvent,
    SharingCounters,
)
from spec.api import OPERATIONS, Argument, Kind
from spec.event_stream import EventBatch, StreamError
from spec.invariants import is_state_hit_exact, is_window_tight
from tests.support.stream_check import SpecPublisher, StreamChecker

# The errors the spec may raise for a refused operation; anything else is a bug.
SPECIFIED_ERRORS = (TypeError, ValueError, KeyError, BlockAllocationError)


@dataclass(frozen=True, slots=True)
class Bounds:
    """One pool shape and the argument ranges every operation is tried with."""

    total_blocks: int
    block_size: int
    request_ids: tuple[str, ...]
    max_token_count: int
    # Prompts for the sharing operations (allocate and append by token ids, fork, reset,
    # the prefix query); none means the walk tries only the count-based operations.
    prompts: tuple[tuple[int, ...], ...] = ()
    # The pool's KV cache groups (spec.init's group_windows).
    group_windows: tuple[spec.GroupEntry, ...] = (None,)
    # A sliding window frees blocks as a request grows, so with windows alone token counts
    # are not bounded by the pool: a state with a request longer than the pool's capacity
    # by more than this is checked on arrival but not walked from. (A full-attention group
    # bounds them by the capacity, so a pool with one never meets this.)
    tokens_past_capacity: int = 2
    # The cache salts each prompt is tried with (two tenants: ``(None, "a")``).
    cache_salts: tuple[str | None, ...] = (None,)
    # The host tier's blocks (spec.init's host_blocks); with any, the swap operations are
    # tried too.
    host_blocks: int = 0
    # Whether freed cached blocks are demoted to the host tier (spec.init's flag).
    host_prefix_cache: bool = False

    def __str__(self) -> str:
        sharing = f" prompts={len(self.prompts)}" if self.prompts else ""
        if self.cache_salts != (None,):
            sharing += f" cache_salts={self.cache_salts}"
        groups = f" group_windows={self.group_windows}" if self.group_windows != (None,) else ""
        if self.host_blocks:
            groups += f" host_blocks={self.host_blocks}"
        if self.host_prefix_cache:
            groups += " host_prefix_cache"
        return (
            f"blocks={self.total_blocks} block_size={self.block_size} "
            f"request_ids={len(self.request_ids)} token_counts=-1..{self.max_token_count}"
            f"{sharing}{groups}"
        )


@dataclass(frozen=True, slots=True)
class Operation:
    """One call: the name of an API operation (a row of ``spec.api.OPERATIONS``, a method
    of ``KVCacheManager``) and its arguments."""

    name: str
    args: tuple[object, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}({', '.join(repr(arg) for arg in self.args)})"


@dataclass(frozen=True, slots=True)
class Violation:
    """A broken check: the shortest path from ``init`` whose last operation breaks it."""

    bounds: Bounds
    path: tuple[Operation, ...]
    reason: str

    def __str__(self) -> str:
        steps = "\n".join(f"  {i}. {op}" for i, op in enumerate(self.path, start=1))
        return f"{self.bounds}: {self.reason}\npath from init:\n{steps}"


@dataclass(frozen=True, slots=True)
class Report:
    """What one bounded walk covered, and the first violation if it met one."""

    bounds: Bounds
    states: int
    transitions: int
    depth: int
    seconds: float
    violation: Violation | None

    def __str__(self) -> str:
        return (
            f"{self.bounds}: {self.states} states, {self.transitions} transitions, "
            f"depth {self.depth}, {self.seconds:.1f} s"
        )


def _spec_step(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    return OPERATIONS[op.name].transition(state, *op.args)


class EventLog(list[KVCacheEvent]):
    """A pool's event sinks: the device events of the transition being checked (the list),
    the host prefix cache's, and impl's publisher, fed both."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.host_events: list[KVCacheEvent] = []
        self.publisher = EventPublisher(block_size)

    def record(self, event: KVCacheEvent) -> None:
        self.append(event)
        self.publisher.record(event)

    def record_host(self, event: KVCacheEvent) -> None:
        self.host_events.append(event)
        self.publisher.record_host(event)

    def clear(self) -> None:
        """Forget the events so far, published or not."""
        super().clear()
        self.host_events.clear()
        self.publisher.end_step()


def _impl_step(pool: KVCacheManager, op: Operation) -> object:
    return getattr(pool, op.name)(*op.args)


def argument_values(argument: Argument, bounds: Bounds) -> tuple[object, ...]:
    """Every value of one kind of argument within ``bounds``, valid or not: each request
    id (so unknown and duplicate ids come up) and, for a fork's child, ``None`` (an id of
    the wrong type); token counts from -1 to ``max_token_count`` (so negative counts and
    exhaustion come up) and ``None`` (a count of the wrong type); the prompts and the
    one-token appends (0,) and (1,) as token ids; each salt."""
    counts = tuple(range(-1, bounds.max_token_count + 1))
    # No count at all: refused with a TypeError, and the state unchanged.
    malformed = (None,)
    prompts = bounds.prompts
    token_ids = (*prompts, *(ids for ids in ((0,), (1,)) if ids not in prompts)) if prompts else ()
    values: dict[Argument, tuple[object, ...]] = {
        Argument.REQUEST_ID: bounds.request_ids,
        Argument.CHILD_ID: (*bounds.request_ids, None),  # None: an id that is no str
        Argument.TOKENS: counts + token_ids + malformed,
        Argument.TOKEN_COUNT: counts + malformed,
        Argument.CACHE_SALT: bounds.cache_salts,
        Argument.PROMPT: prompts,
    }
    return values[argument]


def rows(bounds: Bounds) -> list[str]:
    """The rows of ``spec.api.OPERATIONS`` walked within ``bounds``: every one, but forks
    only with prompts or a host tier and swaps only with a host tier (the walks that
    exercise sharing and the host tier: with them, the count-based walk's pools reach
    more states than CI can walk)."""
    skipped = set()
    if not (bounds.prompts or bounds.host_blocks):
        skipped.add("fork")
    if not bounds.host_blocks:
        skipped.update(("swap_out", "swap_in"))
    return [name for name in OPERATIONS if name not in skipped]


def operations(bounds: Bounds) -> list[Operation]:
    """Every call tried from every state: each row walked (``rows``) with every combination
    of its arguments' values (``argument_values``), in a fixed order (so paths are
    reproducible). A count is allocated without a salt (with one it is refused: tried
    once per salt, with 0 tokens)."""
    ops: list[Operation] = []
    for name in rows(bounds):
        domains = [argument_values(a, bounds) for a in OPERATIONS[name].arguments]
        for combination in product(*domains):
            args = tuple(combination)
            if name == "allocate" and args[2] is None:
                args = args[:2]  # no salt: the default
            elif name == "allocate" and not isinstance(args[1], tuple):
                if args[2] == bounds.cache_salts[0]:
                    args = args[:2]  # a count goes without a salt, once whatever the salts
                elif args[1] != 0:
                    continue
            ops.append(Operation(name, args))
    return list(dict.fromkeys(ops))


# -- checking one transition ---------------------------------------------------------------


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}({error})"


def _same_error(expected: BaseException, actual: BaseException) -> bool:
    return type(expected) is type(actual) and str(expected) == str(actual)


def _computed_tokens(before: AllocatorState, op: Operation, result: object) -> int:
    """L0 of an adding operation (``allocate``, ``append``): the tokens already computed
    when it adds its own (a prompt's hit; the length before an append)."""
    assert isinstance(result, spec.AppendedSlots)
    if op.name == "allocate":
        return result.cached_tokens
    return before.tables[result.request_id].token_count


def _check_spec_step(
    before: AllocatorState, op: Operation, after: AllocatorState, result: object
) -> str | None:
    """What is wrong with a spec step that succeeded (it returned ``result``), or None."""
    broken = spec.violated_invariants(after)
    if broken:
        return f"spec breaks invariant(s) {', '.join(broken)}"
    cached = spec.get_cached_blocks(after)
    try:
        replayed = spec.replay_events(after.events, spec.get_cached_blocks(before))
    except spec.EventReplayError as error:
        return f"spec's events {list(after.events)} do not replay: {error}"
    if replayed != cached:
        return (
            f"spec's events {list(after.events)} replay to {sorted(replayed)}, not {sorted(cached)}"
        )
    problem = _check_stream(before, after, SpecPublisher(before.block_size, before).publish(after))
    if problem is not None:
        return f"spec's {problem}"
    if isinstance(result, spec.AppendedSlots):
        request_id = result.request_id
        if not is_window_tight(after, request_id, _computed_tokens(before, op, result)):
            return "spec left a block wholly outside its window in a table"
        if op.name == "allocate" and not is_state_hit_exact(
            before, after, request_id, result.cached_tokens
        ):
            return "spec's state group restored a state other than the checkpoint at its hit"
    if (after.total_blocks, after.block_size) != (before.total_blocks, before.block_size):
        return "spec changed the pool's shape"
    touched = {arg for arg in op.args if isinstance(arg, str)}
    others_before = {k: v for k, v in before.tables.items() if k not in touched}
    others_after = {k: v for k, v in after.tables.items() if k not in touched}
    if others_before != others_after:
        return "spec changed the table of a request it was not asked about"
    return None


def _check_stream(
    before: AllocatorState, after: AllocatorState, batches: tuple[EventBatch, ...]
) -> str | None:
    """What is wrong with ``batches`` as the stream of the step from ``before`` to ``after``
    (read before ``take_events``), or None."""
    try:
        StreamChecker(before.block_size, before).check(after, batches, "stream")
    except StreamError as error:
        return str(error)
    return None


def _check_impl_state(pool: KVCacheManager, expected: AllocatorState) -> str | None:
    """How the impl's state differs from ``expected``, or None when it matches."""
    actual = pool.to_spec()
    if actual != expected:
        return f"impl state {actual} != spec state {expected}"
    report = pool.usage()
    if not spec.is_usage_consistent(expected, report):
        return f"impl usage {report} != spec usage {spec.usage(expected)}"
    # NOTE: not ``check_invariants``: the spec invariants of ``expected`` were checked when
    # the walk reached it (``_check_initial``, ``_check_spec_step``), and impl's state equals
    # it, so running them again on ``to_spec()`` only repeated them. That was 42% of the
    # largest walk's time; the caches' hash index is what ``to_spec()`` cannot show.
    try:
        check_indexes(pool)
    except AssertionError as error:
        return f"impl check_indexes: {error}"
    return None


def _check_initial(pool: KVCacheManager, state: AllocatorState) -> str | None:
    """What is wrong with ``init``'s state or a fresh pool in it, or None."""
    broken = spec.violated_invariants(state)
    if broken:
        return f"after init: spec breaks invariant(s) {', '.join(broken)}"
    problem = _check_impl_state(pool, state)
    return None if problem is None else f"after init: {problem}"


def check_transition(
    before: AllocatorState, op: Operation, pool: KVCacheManager, events: EventLog
) -> tuple[AllocatorState, str | None]:
    """Apply ``op`` to the spec state and to ``pool`` (in that state, its sink ``events``
    empty); return the new spec state, its events taken, and what went wrong, if anything."""
    try:
        emitted, expected = _spec_step(before, op)
    except SPECIFIED_ERRORS as error:
        return before, _check_refusal(error, op, pool, events, before)
    except Exception as error:
        return before, f"spec raised an unspecified {_describe(error)}"
    after = spec.take_events(emitted)
    problem = _check_spec_step(before, op, emitted, expected)
    if problem is not None:
        return after, problem
    try:
        actual = _impl_step(pool, op)
    except Exception as error:
        return after, f"spec returned {expected!r} but impl raised {_describe(error)}"
    if actual != as_impl(expected):
        return after, f"spec returned {expected!r} but impl returned {actual!r}"
    problem = _check_stream(before, emitted, events.publisher.end_step())
    if problem is not None:
        return after, f"impl's {problem}"
    if events != list(emitted.events):
        return after, f"spec emitted events {list(emitted.events)}, impl {events}"
    return after, _check_impl_state(pool, after)


def _check_refusal(
    expected: BaseException,
    op: Operation,
    pool: KVCacheManager,
    events: EventLog,
    before: AllocatorState,
) -> str | None:
    try:
        actual = _impl_step(pool, op)
    except Exception as error:
        if not _same_error(expected, error):
            return f"spec raised {_describe(expected)} but impl raised {_describe(error)}"
        if events or events.host_events:
            return f"refused {op} emitted events {events + events.host_events}"
        problem = _check_impl_state(pool, before)
        return None if problem is None else f"refused {op} was not atomic: {problem}"
    return f"spec raised {_describe(expected)} but impl returned {actual!r}"


# -- the breadth-first walk ----------------------------------------------------------------


def _new_pool(
    target_class: type[KVCacheManager], bounds: Bounds
) -> tuple[KVCacheManager, EventLog]:
    events = EventLog(bounds.block_size)
    if not bounds.host_blocks:  # a planted bug's own constructor may not take a host tier
        pool = target_class(
            bounds.total_blocks,
            bounds.block_size,
            group_windows=bounds.group_windows,
            event_sink=events.record,
        )
        return pool, events
    pool = target_class(
        bounds.total_blocks,
        bounds.block_size,
        group_windows=bounds.group_windows,
        event_sink=events.record,
        host_event_sink=events.record_host,
        host_blocks=bounds.host_blocks,
        host_prefix_cache=bounds.host_prefix_cache,
    )
    return pool, events


def _replay(
    target_class: type[KVCacheManager], bounds: Bounds, path: Sequence[Operation]
) -> tuple[KVCacheManager, EventLog]:
    """A pool in the state ``path`` leads to, and its sink, empty (for the next operation
    checked from there)."""
    pool, events = _new_pool(target_class, bounds)
    for op in path:
        _impl_step(pool, op)
    events.clear()
    return pool, events


def _initial_state(bounds: Bounds) -> AllocatorState:
    return spec.init(
        bounds.total_blocks,
        bounds.block_size,
        bounds.group_windows,
        bounds.host_blocks,
        bounds.host_prefix_cache,
    )


def _path_to(
    state: AllocatorState, parents: dict[AllocatorState, tuple[AllocatorState, Operation] | None]
) -> list[Operation]:
    path: list[Operation] = []
    link = parents[state]
    while link is not None:
        state, op = link
        path.append(op)
        link = parents[state]
    path.reverse()
    return path


# Copy-on-write copies pile up until ``take_copies``; a state with more than this many
# pending is checked on arrival but not walked from, or the reachable space is infinite.
MAX_PENDING = 1


def _is_walked_from(state: AllocatorState, bounds: Bounds) -> bool:
    """Whether the walk goes on from ``state`` (see ``MAX_PENDING`` and
    ``Bounds.tokens_past_capacity``)."""
    longest = max((table.token_count for table in state.tables.values()), default=0)
    capacity = state.total_blocks * state.block_size
    return (
        len(state.pending_copies) <= MAX_PENDING
        and longest <= capacity + bounds.tokens_past_capacity
    )


def _identity(state: AllocatorState) -> AllocatorState:
    """A state without its running counters: what makes two states the same for the walk.

    NOTE: the counters (hits, evictions, copies, preemptions) only grow, so with them the
    reachable space of the sharing operations would be infinite. Every transition still
    compares them between spec and impl.
    """
    host = replace(state.host, counters=HostCounters())
    return replace(state, counters=SharingCounters(), host=host)


def check(bounds: Bounds, target_class: type[KVCacheManager] = KVCacheManager) -> Report:
    """Walk every reachable state within ``bounds``; stop at the first violation."""
    started = time.perf_counter()
    initial = _initial_state(bounds)
    parents: dict[AllocatorState, tuple[AllocatorState, Operation] | None] = {initial: None}
    frontier: deque[tuple[AllocatorState, int]] = deque([(initial, 0)])
    ops = operations(bounds)
    transitions = 0
    depth = 0

    def report(violation: Violation | None) -> Report:
        seconds = time.perf_counter() - started
        return Report(bounds, len(parents), transitions, depth, seconds, violation)

    problem = _check_initial(_replay(target_class, bounds, ())[0], initial)
    if problem is not None:
        return report(Violation(bounds, (), problem))
    while frontier:
        state, depth = frontier.popleft()
        path = _path_to(_identity(state), parents)
        pool: tuple[KVCacheManager, EventLog] | None = None
        # The operations the pool ran since it was replayed, each leaving it in ``state``.
        ran: list[Operation] = []
        for op in ops:
            transitions += 1
            if pool is None:
                pool, ran = _replay(target_class, bounds, path), []
            pool[1].clear()  # a call that left the state as it was may still have emitted
            after, problem = check_transition(state, op, *pool)
            if problem is not None:
                violation = _violation(
                    bounds, path, ran, op, problem=problem, target_class=target_class
                )
                return report(violation)
            ran.append(op)
            if after is not state and OPERATIONS[op.name].kind is Kind.CHANGE:
                # A change carried out, even one that left the state as it was (an append
                # of 0 tokens), may move what the state does not show: replay afresh.
                pool = None
            if _identity(after) not in parents and _is_walked_from(after, bounds):
                parents[_identity(after)] = (_identity(state), op)
                frontier.append((after, depth + 1))
    return report(None)


def _violation(
    bounds: Bounds,
    path: list[Operation],
    ran: list[Operation],
    op: Operation,
    *,
    problem: str,
    target_class: type[KVCacheManager],
) -> Violation:
    """The violation of ``op`` from the state ``path`` leads to, on a pool that also ran
    ``ran`` there (refused calls and queries, each checked to leave the state as it was).

    NOTE: reusing the pool across refusals and queries saves most replays of a walk; if
    the violation needs them (a refusal that changed something ``to_spec()`` does not
    show), the path names them, so it reproduces."""
    if ran and check_path(bounds, (*path, op), target_class) is None:
        return Violation(bounds, (*path, *ran, op), problem)
    return Violation(bounds, (*path, op), problem)


def check_path(
    bounds: Bounds, path: Sequence[Operation], target_class: type[KVCacheManager] = KVCacheManager
) -> Violation | None:
    """Run one path from ``init`` with every check of the walk; the first violation, if any."""
    state = _initial_state(bounds)
    pool, events = _new_pool(target_class, bounds)
    problem = _check_initial(pool, state)
    if problem is not None:
        return Violation(bounds, (), problem)
    for steps, op in enumerate(path, start=1):
        events.clear()
        state, problem = check_transition(state, op, pool, events)
        if problem is not None:
            return Violation(bounds, tuple(path[:steps]), problem)
    return None


def sharing_prompts(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Prompts that make every sharing case reachable in a tiny pool: a prefix hit (the
    first two share a full block), a hit capped at the last token (the third is exactly
    that block), and a prompt that shares nothing."""
    full = (0,) * block_size
    return ((*full, 1), (*full, 0), full, (1,))


def all_sharing_bounds(max_blocks: int, max_block_size: int, request_ids: int) -> Iterator[Bounds]:
    """Every pool shape up to the maxima with the sharing operations, smallest first.

    Token counts for the count-based operations stay at -1..1: those are walked in full by
    ``all_bounds``; here they only mix count-based requests into the sharing ones.
    """
    ids = tuple(f"r{i}" for i in range(request_ids))
    for total_blocks in range(1, max_blocks + 1):
        for block_size in range(1, max_block_size + 1):
            yield Bounds(total_blocks, block_size, ids, 1, sharing_prompts(block_size))


# The salt walk: two tenants (no salt and "a") over the sharing prompts, in blocks of one
# token (so a two-token prompt fills a chain of two blocks). Two request ids in 2 blocks
# reach 4,114 states (~55 s): the state machine covers those.
SALT_SHAPES: tuple[tuple[int, int, int], ...] = ((1, 1, 2), (2, 1, 1))


def all_salt_bounds() -> Iterator[Bounds]:
    """``SALT_SHAPES`` (blocks, block_size, request ids) with the sharing operations and
    every prompt tried under both salts, smallest first."""
    for total_blocks, block_size, request_ids in SALT_SHAPES:
        ids = tuple(f"r{i}" for i in range(request_ids))
        prompts = sharing_prompts(block_size)
        yield Bounds(total_blocks, block_size, ids, 1, prompts, cache_salts=(None, "a"))


# The window walk: (blocks, block_size, group_windows) with the count-based operations,
# then with the sharing ones. Windows of 1 and 2 tokens in blocks of 1, a window of 3 in
# blocks of 2 (not a multiple of the block size), a full group beside a windowed one.
# One request id: with two, the 2-block sharing pools alone reach 6,648 states (~160 s);
# forks under windows are the state machine's and the scenarios' (see docs/verification.md).
WINDOW_COUNT_SHAPES: tuple[tuple[int, int, tuple[int | None, ...]], ...] = (
    (3, 1, (1,)),
    (3, 1, (2,)),
    (3, 2, (3,)),
    (4, 1, (None, 2)),
)
WINDOW_SHARING_SHAPES: tuple[tuple[int, int, tuple[int | None, ...]], ...] = (
    (2, 1, (1,)),
    (2, 1, (2,)),
    (2, 2, (3,)),
)


def all_window_bounds() -> Iterator[Bounds]:
    """The window walk: ``WINDOW_COUNT_SHAPES`` with counts -1..2, two tokens past the
    capacity; then ``WINDOW_SHARING_SHAPES`` with the sharing prompts (prefix hits with
    born-skipped blocks, rollbacks into a window), counts -1..1, none past the capacity."""
    for total_blocks, block_size, group_windows in WINDOW_COUNT_SHAPES:
        yield Bounds(total_blocks, block_size, ("r0",), 2, (), group_windows)
    for total_blocks, block_size, group_windows in WINDOW_SHARING_SHAPES:
        prompts = sharing_prompts(block_size)
        yield Bounds(total_blocks, block_size, ("r0",), 1, prompts, group_windows, 0)


# The host-tier walk: (blocks, block_size, request ids, host blocks), a 2-block host tier,
# with the count-based operations, forks and the swaps (shared blocks swapped out, swaps
# in before the copies are taken, releases of swapped requests), then with the sharing
# ones (prefix hits on blocks in flight). Token counts -1..1. The 2-block pool with two
# request ids and the sharing operations reaches too many states for CI (killed past
# 5 min); the host-tier state machine covers it.
HOST_COUNT_SHAPES: tuple[tuple[int, int, int, int], ...] = ((1, 1, 2, 2), (2, 1, 2, 2))
HOST_SHARING_SHAPES: tuple[tuple[int, int, int, int], ...] = ((1, 1, 2, 2),)
# The host prefix cache: 2 blocks of 1 token, one request id, a 1-block host tier, the
# prompts (0,) and (0, 1) under the salt "a" (a demoted key must keep it): a prefix
# demoted, evicted from the device and revived from the host. With both salts and the
# four sharing prompts it reaches 3,950 states (~100 s under load).
HOST_PREFIX_BOUNDS = Bounds(
    2, 1, ("r0",), 1, ((0,), (0, 1)), cache_salts=("a",), host_blocks=1, host_prefix_cache=True
)


def all_host_bounds() -> Iterator[Bounds]:
    """The host-tier walk: ``HOST_COUNT_SHAPES``, then ``HOST_SHARING_SHAPES`` with the
    sharing prompts, then ``HOST_PREFIX_BOUNDS``."""
    for total_blocks, block_size, request_ids, host_blocks in HOST_COUNT_SHAPES:
        ids = tuple(f"r{i}" for i in range(request_ids))
        yield Bounds(total_blocks, block_size, ids, 1, host_blocks=host_blocks)
    for total_blocks, block_size, request_ids, host_blocks in HOST_SHARING_SHAPES:
        ids = tuple(f"r{i}" for i in range(request_ids))
        prompts = sharing_prompts(block_size)
        yield Bounds(total_blocks, block_size, ids, 1, prompts, host_blocks=host_blocks)
    yield HOST_PREFIX_BOUNDS


# The hybrid walk (``spec.kinds``): (blocks, block_size, group_windows), one request id,
# token counts -1..0 and the hybrid prompts. A window of one token beside a state group
# checkpointed every two tokens: the window needs no block for a hit and frees one as it
# slides, so in 3 blocks a request decodes past two checkpoints and a prompt hits one (a
# full-attention group needs 4 blocks for that: 4,584 states, ~80 s under load). Then a
# full-attention group beside a state group checkpointed every token.
HYBRID_SHAPES: tuple[tuple[int, int, tuple[spec.GroupEntry, ...]], ...] = (
    (3, 1, (1, spec.RecurrentState(2))),
    (3, 1, (None, spec.RecurrentState(1))),
)


def hybrid_prompts(interval: int) -> tuple[tuple[int, ...], ...]:
    """Prompts that reach every case of the state group's hit rule in a tiny pool: one
    token, which decodes (appends of (0,)) to the checkpoints at C and 2C, and 2C zeros
    and a one, whose hit at 2C needs the checkpoint there and may not take the one at C."""
    return ((0,), (0,) * (2 * interval) + (1,))


def all_hybrid_bounds() -> Iterator[Bounds]:
    """The hybrid walk: ``HYBRID_SHAPES`` with the hybrid prompts of their intervals."""
    for total_blocks, block_size, group_windows in HYBRID_SHAPES:
        (interval,) = (k.interval for k in group_windows if isinstance(k, spec.RecurrentState))
        prompts = hybrid_prompts(interval)
        yield Bounds(total_blocks, block_size, ("r0",), 0, prompts, group_windows, 0)


def all_bounds(
    max_blocks: int, max_block_size: int, request_ids: int, max_token_count: int | None
) -> Iterator[Bounds]:
    """Every pool shape up to the maxima, smallest first."""
    ids = tuple(f"r{i}" for i in range(request_ids))
    for total_blocks in range(1, max_blocks + 1):
        for block_size in range(1, max_block_size + 1):
            # One past the pool's capacity, so that exhaustion is always tried.
            tokens = max_token_count
            if tokens is None:
                tokens = total_blocks * block_size + 1
            yield Bounds(total_blocks, block_size, ids, tokens)


def load_target(dotted: str) -> type[KVCacheManager]:
    """``module:Class`` to the class, e.g. ``tests.support.planted_bugs:LeaksOneBlockOnRelease``."""
    module_name, _, class_name = dotted.partition(":")
    target = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(target, type) and issubclass(target, KVCacheManager)):
        raise ValueError(f"{dotted} is not a KVCacheManager class")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Check every configuration up to the bounds given; 1 at the first violation."""
    parser = argparse.ArgumentParser(prog="python -m tests.support.bounded", description=__doc__)
    parser.add_argument("--max-blocks", type=int, default=3, help="pools of 1..N blocks")
    parser.add_argument("--max-block-size", type=int, default=3, help="block sizes 1..N")
    parser.add_argument("--request-ids", type=int, default=3, help="request ids r0..r(N-1)")
    parser.add_argument(
        "--max-token-count",
        type=int,
        default=None,
        help="token counts tried are -1..N (default: one past each pool's capacity)",
    )
    parser.add_argument(
        "--target", default="impl:KVCacheManager", help="module:Class of the allocator to check"
    )
    parser.add_argument(
        "--sharing",
        action="store_true",
        help="walk the sharing operations (prompts, token appends, fork, preempt, copies) "
        "instead of the count-based ones; token counts -1..1",
    )
    parser.add_argument(
        "--host-tier",
        action="store_true",
        help="walk the fixed host-tier shapes (swap out, swap in, copies) instead",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="walk the fixed hybrid shapes (a recurrent state group beside attention) instead",
    )
    parser.add_argument(
        "--windows",
        action="store_true",
        help="walk the fixed window shapes (KV cache groups with sliding windows) instead",
    )
    args = parser.parse_args(argv)
    target_class = load_target(args.target)
    total_states = total_transitions = 0
    started = time.perf_counter()
    if args.host_tier:
        walks = all_host_bounds()
    elif args.windows:
        walks = all_window_bounds()
    elif args.hybrid:
        walks = all_hybrid_bounds()
    elif args.sharing:
        walks = all_sharing_bounds(args.max_blocks, args.max_block_size, args.request_ids)
    else:
        walks = all_bounds(
            args.max_blocks, args.max_block_size, args.request_ids, args.max_token_count
        )
    for bounds in walks:
        result = check(bounds, target_class)
        print(result, flush=True)
        total_states += result.states
        total_transitions += result.transitions
        if result.violation is not None:
            print(f"VIOLATION in {target_class.__name__}: {result.violation}")
            return 1
    seconds = time.perf_counter() - started
    print(
        f"all configurations: {total_states} states, {total_transitions} transitions, "
        f"{seconds:.1f} s, no violation in {target_class.__name__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
