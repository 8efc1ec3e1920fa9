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

Breadth first means the first violation met is one with the shortest path from ``init``;
that path is the report. It is a tool for tests, not a prover: it covers only the bounds it
is given, and the impl only along the shortest path to each state.

Run ``python -m tests.bounded --max-blocks 3 --max-block-size 3`` (``--help`` for the rest).
"""

import argparse
import importlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import spec
from impl import KVBlockManager
from spec import AllocatorState, BlockAllocationError

# The errors the spec may raise for a refused operation; anything else is a bug.
SPECIFIED_ERRORS = (ValueError, KeyError, BlockAllocationError)


@dataclass(frozen=True, slots=True)
class Bounds:
    """One pool shape and the argument ranges every operation is tried with."""

    total_blocks: int
    block_size: int
    request_ids: tuple[str, ...]
    max_token_count: int

    def __str__(self) -> str:
        return (
            f"blocks={self.total_blocks} block_size={self.block_size} "
            f"request_ids={len(self.request_ids)} token_counts=-1..{self.max_token_count}"
        )


@dataclass(frozen=True, slots=True)
class Operation:
    """One call: an operation's name and its arguments (those it does not take are unused)."""

    name: str
    request_id: str = ""
    token_count: int = 0

    def __str__(self) -> str:
        if self.name in _TAKES_REQUEST_AND_COUNT:
            return f"{self.name}({self.request_id!r}, {self.token_count})"
        if self.name in _TAKES_COUNT:
            return f"{self.name}({self.token_count})"
        return f"{self.name}({self.request_id!r})"


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


_TAKES_REQUEST_AND_COUNT = ("allocate", "append_tokens")
_TAKES_COUNT = ("can_allocate",)

# -- what each operation means in the spec, and how to call it on the impl ----------------

SpecStep = Callable[[AllocatorState, Operation], tuple[AllocatorState, object]]
ImplStep = Callable[[KVBlockManager, Operation], object]


def _spec_allocate(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    after = spec.allocate(state, op.request_id, op.token_count)
    return after, spec.block_table(after, op.request_id)


def _spec_append_tokens(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    after = spec.append_tokens(state, op.request_id, op.token_count)
    return after, spec.block_table(after, op.request_id)


def _spec_append_slot(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    # append_slot is append_tokens(request_id, 1) that returns the new token's slot.
    after = spec.append_tokens(state, op.request_id, 1)
    position = state.tables[op.request_id].token_count
    block_ids = spec.block_table(after, op.request_id).block_ids
    return after, spec.slot_index(state.block_size, block_ids, position)


def _spec_release(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    released = list(spec.block_table(state, op.request_id).block_ids)
    return spec.release(state, op.request_id), released


def _spec_snapshot_request(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    return state, spec.block_table(state, op.request_id)


def _spec_can_allocate(state: AllocatorState, op: Operation) -> tuple[AllocatorState, object]:
    needed = spec.blocks_for_tokens(state.block_size, op.token_count)
    return state, needed <= len(state.free_block_ids)


SPEC_STEPS: dict[str, SpecStep] = {
    "allocate": _spec_allocate,
    "append_tokens": _spec_append_tokens,
    "append_slot": _spec_append_slot,
    "release": _spec_release,
    "snapshot_request": _spec_snapshot_request,
    "can_allocate": _spec_can_allocate,
}

IMPL_STEPS: dict[str, ImplStep] = {
    "allocate": lambda pool, op: pool.allocate(op.request_id, op.token_count),
    "append_tokens": lambda pool, op: pool.append_tokens(op.request_id, op.token_count),
    "append_slot": lambda pool, op: pool.append_slot(op.request_id),
    "release": lambda pool, op: pool.release(op.request_id),
    "snapshot_request": lambda pool, op: pool.snapshot_request(op.request_id),
    "can_allocate": lambda pool, op: pool.can_allocate(op.token_count),
}


def operations(bounds: Bounds) -> list[Operation]:
    """Every call tried from every state, in a fixed order (so paths are reproducible)."""
    token_counts = range(-1, bounds.max_token_count + 1)
    ops: list[Operation] = []
    for request_id in bounds.request_ids:
        ops += [Operation("allocate", request_id, n) for n in token_counts]
        ops += [Operation("append_tokens", request_id, n) for n in token_counts]
        ops += [Operation(name, request_id) for name in ("append_slot", "release")]
        ops.append(Operation("snapshot_request", request_id))
    ops += [Operation("can_allocate", token_count=n) for n in token_counts]
    return ops


# -- checking one transition ---------------------------------------------------------------


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}({error})"


def _same_error(expected: BaseException, actual: BaseException) -> bool:
    return type(expected) is type(actual) and str(expected) == str(actual)


def _check_spec_step(before: AllocatorState, op: Operation, after: AllocatorState) -> str | None:
    """What is wrong with a spec step that succeeded, or None."""
    broken = spec.violated_invariants(after)
    if broken:
        return f"spec breaks invariant(s) {', '.join(broken)}"
    if (after.total_blocks, after.block_size) != (before.total_blocks, before.block_size):
        return "spec changed the pool's shape"
    others_before = {k: v for k, v in before.tables.items() if k != op.request_id}
    others_after = {k: v for k, v in after.tables.items() if k != op.request_id}
    if others_before != others_after:
        return "spec changed the table of a request it was not asked about"
    return None


def _check_impl_state(pool: KVBlockManager, expected: AllocatorState) -> str | None:
    """How the impl's state differs from ``expected``, or None when it matches."""
    actual = pool.to_spec()
    if actual != expected:
        return f"impl state {actual} != spec state {expected}"
    report = pool.usage()
    if not spec.is_usage_consistent(expected, report):
        return f"impl usage {report} != spec usage {spec.usage(expected)}"
    if pool.num_free_blocks != len(expected.free_block_ids):
        return f"impl num_free_blocks {pool.num_free_blocks} != {len(expected.free_block_ids)}"
    try:
        pool.check_invariants()
    except AssertionError as error:
        return f"impl check_invariants: {error}"
    return None


def check_transition(
    before: AllocatorState, op: Operation, pool: KVBlockManager
) -> tuple[AllocatorState, str | None]:
    """Apply ``op`` to the spec state and to ``pool`` (in that state); return the new spec
    state and what went wrong, if anything."""
    try:
        after, expected = SPEC_STEPS[op.name](before, op)
    except SPECIFIED_ERRORS as error:
        return before, _check_refusal(error, op, pool, before)
    except Exception as error:
        return before, f"spec raised an unspecified {_describe(error)}"
    problem = _check_spec_step(before, op, after)
    if problem is not None:
        return after, problem
    try:
        actual = IMPL_STEPS[op.name](pool, op)
    except Exception as error:
        return after, f"spec returned {expected!r} but impl raised {_describe(error)}"
    if actual != expected:
        return after, f"spec returned {expected!r} but impl returned {actual!r}"
    return after, _check_impl_state(pool, after)


def _check_refusal(
    expected: BaseException, op: Operation, pool: KVBlockManager, before: AllocatorState
) -> str | None:
    try:
        actual = IMPL_STEPS[op.name](pool, op)
    except Exception as error:
        if not _same_error(expected, error):
            return f"spec raised {_describe(expected)} but impl raised {_describe(error)}"
        problem = _check_impl_state(pool, before)
        return None if problem is None else f"refused {op} was not atomic: {problem}"
    return f"spec raised {_describe(expected)} but impl returned {actual!r}"


# -- the breadth-first walk ----------------------------------------------------------------


def _replay(
    target_class: type[KVBlockManager], bounds: Bounds, path: Sequence[Operation]
) -> KVBlockManager:
    pool = target_class(bounds.total_blocks, bounds.block_size)
    for op in path:
        IMPL_STEPS[op.name](pool, op)
    return pool


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


def check(bounds: Bounds, target_class: type[KVBlockManager] = KVBlockManager) -> Report:
    """Walk every reachable state within ``bounds``; stop at the first violation."""
    started = time.perf_counter()
    initial = spec.init(bounds.total_blocks, bounds.block_size)
    parents: dict[AllocatorState, tuple[AllocatorState, Operation] | None] = {initial: None}
    frontier: deque[tuple[AllocatorState, int]] = deque([(initial, 0)])
    ops = operations(bounds)
    transitions = 0
    depth = 0

    def report(violation: Violation | None) -> Report:
        seconds = time.perf_counter() - started
        return Report(bounds, len(parents), transitions, depth, seconds, violation)

    problem = _check_impl_state(_replay(target_class, bounds, ()), initial)
    if problem is not None:
        return report(Violation(bounds, (), f"after init: {problem}"))
    while frontier:
        state, depth = frontier.popleft()
        path = _path_to(state, parents)
        for op in ops:
            transitions += 1
            pool = _replay(target_class, bounds, path)
            after, problem = check_transition(state, op, pool)
            if problem is not None:
                return report(Violation(bounds, (*path, op), problem))
            if after not in parents:
                parents[after] = (state, op)
                frontier.append((after, depth + 1))
    return report(None)


def check_path(
    bounds: Bounds, path: Sequence[Operation], target_class: type[KVBlockManager] = KVBlockManager
) -> Violation | None:
    """Run one path from ``init`` with every check of the walk; the first violation, if any."""
    state = spec.init(bounds.total_blocks, bounds.block_size)
    pool = target_class(bounds.total_blocks, bounds.block_size)
    problem = _check_impl_state(pool, state)
    if problem is not None:
        return Violation(bounds, (), f"after init: {problem}")
    for steps, op in enumerate(path, start=1):
        state, problem = check_transition(state, op, pool)
        if problem is not None:
            return Violation(bounds, tuple(path[:steps]), problem)
    return None


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


def load_target(dotted: str) -> type[KVBlockManager]:
    """``module:Class`` (e.g. ``tests.planted_bugs:LeaksOneBlockOnRelease``) to the class."""
    module_name, _, class_name = dotted.partition(":")
    target = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(target, type) and issubclass(target, KVBlockManager)):
        raise ValueError(f"{dotted} is not a KVBlockManager class")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Check every configuration up to the bounds given; 1 at the first violation."""
    parser = argparse.ArgumentParser(prog="python -m tests.bounded", description=__doc__)
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
        "--target", default="impl:KVBlockManager", help="module:Class of the allocator to check"
    )
    args = parser.parse_args(argv)
    target_class = load_target(args.target)
    total_states = total_transitions = 0
    started = time.perf_counter()
    for bounds in all_bounds(
        args.max_blocks, args.max_block_size, args.request_ids, args.max_token_count
    ):
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
