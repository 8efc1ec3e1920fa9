"""What a target allocator offers the conformance kit: the two adapter protocols and what
they expose.

An adapter wraps one allocator in the spec's vocabulary (``spec``'s operation names and
arguments) and reports what it holds, in the target's own block ids. The contract, which
every bundled adapter keeps and docs/conformance.md spells out:

- the factory the kit is given returns a fresh allocator, in its initial state, at every
  call (one per test case: nothing may carry over from a previous case);
- a capacity refusal is raised as ``spec.BlockAllocationError`` whatever the target's own
  signal (a ``None``, a ``False``), and it is atomic: it changes nothing the observation
  shows (a target that keeps a refused step's side effects declares ``refusal_atomic``);
  any other exception is the target's own failure and ends the run;
- ``free_block_ids`` lists the free blocks in the order the target hands them out: its
  first element is the head, the block the next allocation takes (only exact targets are
  held to the order; for the others any order is read as a set);
- ``preempt(request_id)`` gives up a running request's blocks so that it can be recomputed
  later, as a server does under memory pressure; for a target without preemption it is
  ``release``, and its cached blocks stay cached either way.

Two kinds of adapter. An ``Adapter`` is called one operation at a time: the kit draws the
operation, the request and its arguments. An ``EngineAdapter`` wraps a server's own
scheduler: the kit submits requests, then runs whole engine steps (the scheduler decides
who is admitted, who decodes, who is preempted; the kit's stub model decides the sampled
tokens and which requests finish), and the adapter reports each allocator call the step
made, in order, as a ``Call``, with what the target showed just before and just after it.

Not here: checking. The adapter only translates; ``harness.conformance.properties`` and
``harness.conformance.judge`` judge.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from spec.kinds import GroupEntry

# The operations an adapter may support, named and shaped as spec's functions:
#   allocate_prompt(request_id, token_ids) -> cached (hit) tokens
#     (allocate_prompt(request_id, token_ids, cache_salt) too, if it supports CACHE_SALT)
#   allocate(request_id, token_count), append_tokens(request_id, token_count),
#   append_token_ids(request_id, token_ids), fork(parent_id, child_id),
#   release(request_id), preempt(request_id), truncate(request_id, token_count)
OPERATION_NAMES = (
    "allocate_prompt",
    "allocate",
    "append_token_ids",
    "append_tokens",
    "fork",
    "release",
    "preempt",
    "truncate",
)
# What a server does to its allocator that is none of the spec's operations, so an engine
# adapter reports it as a call of its own: ``cache_blocks(request_id)``, hashing the blocks
# a forward pass completed after the forward (the spec caches them in the operation that
# adds the tokens), ``evict()``, dropping cached free blocks outside any allocation, and
# ``take_copies(request_id)``, freeing the in-flight blocks a request's state copies read
# once the forward that made them has run (the spec's ``take_transfers``, one request's).
TARGET_OPERATIONS = ("cache_blocks", "evict", "take_copies")
# Not an operation: in ``supports``, it says ``allocate_prompt`` (or ``submit``) takes a
# ``cache_salt`` (a ``str``; the machine then draws prompts under no salt and a few salts).
CACHE_SALT = "cache_salt"
# Not an operation: in ``supports``, it says the adapter has ``take_events()``, the KV cache
# events of the last step (``harness.conformance.events``), which the kit then judges.
KV_EVENTS = "kv_events"
# A refusal whose message starts with one of these names its own cause, declared apart
# from a plain want of blocks: a deferral (vLLM postpones a hit on a Mamba checkpoint
# cached this step), or an admission gate on the whole prompt where the call admits only
# its first chunk (vLLM's full_sequence_must_fit under chunked prefill).
DEFERRED = "deferred"
WHOLE_PROMPT = "whole_prompt"
REFUSAL_CAUSES = (DEFERRED, WHOLE_PROMPT)


@dataclass(frozen=True, slots=True)
class TargetTable:
    """One request's table in one KV cache group, in target ids: ``block_ids[i]`` holds block
    index ``skipped_blocks + i`` (a window released the first ``skipped_blocks``)."""

    block_ids: tuple[int, ...]
    token_count: int
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything the target shows, in its own block ids.

    ``tables[g]`` is KV cache group g's tables by request id. ``free_block_ids`` are free and
    hold nothing reusable, head first; ``cached_free_block_ids`` are free but still
    findable by a prefix hit (evictable). ``cached_block_ids[g]`` are group g's blocks that
    a prefix hit may find, held or free (``()``: the target does not show them).
    ``ref_counts`` is ``None`` for a target that keeps none. ``in_flight_block_ids`` are
    blocks the target holds in no table of the spec's shape, only as the source of a state
    copy it makes before the next forward; ``pending_copies`` those copies, (source,
    destination) (a recurrent state group's: ``spec.kinds``).
    """

    tables: tuple[Mapping[str, TargetTable], ...]
    free_block_ids: tuple[int, ...]
    cached_free_block_ids: tuple[int, ...] = ()
    cached_block_ids: tuple[frozenset[int], ...] = ()
    ref_counts: Mapping[int, int] | None = field(default=None)
    in_flight_block_ids: tuple[int, ...] = ()
    pending_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a call ended: ``result`` when it was carried out, ``refusal`` (a message) if not."""

    result: object = None
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One allocator call a server made inside an engine step, in the spec's vocabulary
    (``OPERATION_NAMES`` or ``TARGET_OPERATIONS``), with how it ended and what the target
    showed just before and just after it."""

    operation: str
    args: tuple[object, ...]
    outcome: Outcome
    before: Observation
    after: Observation


class ServerError(Exception):
    """The server's own exception inside an engine step (not a capacity refusal), raised by
    an engine adapter from it with the allocator calls the step made before it."""

    def __init__(self, calls: list[Call]) -> None:
        super().__init__(f"the server raised after {len(calls)} allocator call(s)")
        self.calls = calls


def record_calls(calls: list[Call], run: Callable[[], object]) -> list[Call]:
    """Run a server's step, whose watched allocator calls append to ``calls``: those
    calls, or ``ServerError`` with the ones made before the server raised."""
    try:
        run()
    except Exception as error:
        raise ServerError(calls) from error
    return calls


class _Target(Protocol):
    """What both kinds of adapter show."""

    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def group_windows(self) -> tuple[GroupEntry, ...]:
        """Each KV cache group's kind: full attention (``None``), a window W, or a
        recurrent state group (``spec.RecurrentState``)."""
        ...

    @property
    def pool_block_ids(self) -> Sequence[int]:
        """Every block id the target may lend, in any order (the bijection's domain)."""
        ...

    @property
    def supports(self) -> frozenset[str]: ...
    @property
    def differences(self) -> Mapping[str, str]:
        """Properties the target breaks by design: a property name, or
        ``property/operation``, to the reason (counted and reported, not raised)."""
        ...

    def observe(self) -> Observation: ...


class Adapter(_Target, Protocol):
    """An allocator called one operation at a time. Unsupported operations may be absent;
    ``supports`` says which exist."""

    @property
    def exact(self) -> bool:
        """True when the target's block order is the spec's, so ids are compared exactly."""
        ...


class EngineAdapter(_Target, Protocol):
    """A server's scheduler over its allocator, driven a step at a time (module docstring)."""

    def submit(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> None:
        """A request arrives: it waits for the scheduler (no block is lent yet). What it
        raises is the server's own failure, judged as a step's."""
        ...

    def step(self, sampled: Mapping[str, int], finishing: frozenset[str]) -> list[Call]:
        """One engine step: schedule, a forward pass whose model samples ``sampled[r]``
        for each request r that gets a token (a stop token if r is in ``finishing``, so r
        finishes after this forward), and the update; the allocator calls it made. The
        server's own exception is raised as ``ServerError`` from it (``record_calls``);
        anything else it raises is the adapter's fault."""
        ...

    def abort(self, request_id: str) -> list[Call]:
        """The client cancels a request, waiting or running; the allocator calls it made."""
        ...


def is_engine(target: Adapter | EngineAdapter) -> bool:
    """Whether ``target`` is driven by engine steps rather than one operation at a time."""
    return callable(getattr(target, "step", None))
