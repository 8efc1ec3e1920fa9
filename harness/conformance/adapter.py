"""What a target allocator offers the conformance kit: the adapter protocol and what it exposes.

An adapter wraps one allocator in the spec's vocabulary (``spec.api``'s operation names and
arguments) and reports what it holds, in the target's own block ids. It declares which
operations it supports (the machine draws only those) and which properties it differs on by
design (``differences``: a property name, or ``name/operation``, with the reason). A
capacity refusal is raised as ``spec.BlockAllocationError`` whatever the target's own signal
(a ``None``, a ``False``); any other exception is the target's own and ends the run.

Not here: checking. The adapter only translates; ``harness.conformance.properties`` judges.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# The operations an adapter may support, named and shaped as in ``spec.api``:
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
# Not an operation: in ``supports``, it says ``allocate_prompt`` takes a ``cache_salt`` (a
# ``str``; the machine then draws prompts under no salt and under a few salts).
CACHE_SALT = "cache_salt"
# Not an operation: in ``supports``, it says the adapter has ``take_events()``, the KV cache
# events of the last step (``harness.conformance.events``), which the kit then judges.
KV_EVENTS = "kv_events"


@dataclass(frozen=True, slots=True)
class TargetTable:
    """One request's table in one KV cache group, in target ids: ``block_ids[i]`` holds block
    index ``skipped_blocks + i`` (a window released the first ``skipped_blocks``)."""

    block_ids: tuple[int, ...]
    token_count: int
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything the target shows after a step, in its own block ids.

    ``tables[g]`` is KV cache group g's tables by request id. ``free_block_ids`` are free and
    hold nothing reusable; ``cached_free_block_ids`` are free but still findable by a prefix
    hit (evictable). ``cached_block_ids[g]`` are group g's blocks that a prefix hit may find,
    held or free. ``ref_counts`` is ``None`` for a target that keeps none.
    """

    tables: tuple[Mapping[str, TargetTable], ...]
    free_block_ids: tuple[int, ...]
    cached_free_block_ids: tuple[int, ...] = ()
    cached_block_ids: tuple[frozenset[int], ...] = ()
    ref_counts: Mapping[int, int] | None = field(default=None)


class Adapter(Protocol):
    """An allocator seen through the spec's operations. Unsupported operations may be absent;
    ``supports`` says which exist. Each operation either completes, or raises
    ``spec.BlockAllocationError`` for a capacity refusal."""

    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def group_windows(self) -> tuple[int | None, ...]: ...
    @property
    def pool_block_ids(self) -> Sequence[int]:
        """Every block id the target may lend, in any order (the bijection's domain)."""
        ...

    @property
    def supports(self) -> frozenset[str]: ...
    @property
    def exact(self) -> bool:
        """True when the target's block order is the spec's, so ids are compared exactly."""
        ...

    @property
    def differences(self) -> Mapping[str, str]: ...
    def observe(self) -> Observation: ...
