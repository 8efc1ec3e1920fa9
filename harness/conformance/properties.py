"""The properties a target must keep, each named and stated in the spec's vocabulary.

Two kinds. State properties are ``spec.invariants`` run on the target's state as the spec
sees it (``harness.conformance.view``): they hold whatever order the target hands blocks
out in. Step properties compare one step of the target with the spec's operation of the
same name applied to the state the target was in just before (its own free pool, its own
cache): the spec says what the step must give, so a target with its own order policy is
judged on everything but the order. In exact mode one more property compares the whole
state, queue order included, as the lockstep state machine compares impl with spec.

The absolute properties (``ABSOLUTE_PROPERTIES``: what must be cached, what may be
evicted, how long a hit must be against the kit's own shadow) are judged over a whole step
by ``harness.conformance.shadow``. ``step_findings`` returns one call's findings, each with
the target's and the spec's side.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import spec
from harness.conformance.adapter import OPERATION_NAMES, REFUSAL_CAUSES, Observation, Outcome
from spec.invariants import INVARIANTS

# The kit's operation names (``adapter.OPERATION_NAMES``) that are another row of
# ``spec.api``: token ids or a count, the same ``allocate`` and ``append``.
SPEC_ROWS = {"allocate_prompt": "allocate", "append_token_ids": "append", "append_tokens": "append"}
# The spec's transition of each operation an adapter may support: the public function of
# its row (state, arguments) -> state.
SPEC_OPERATIONS: Mapping[str, Callable[..., spec.AllocatorState]] = {
    name: getattr(spec, SPEC_ROWS.get(name, name)) for name in OPERATION_NAMES
}

# spec.invariants that an observation can decide (pending copies and skipped-block lists
# are internal to pagedkv, so ``copy_destination_held`` and ``skipped_pending_free`` are not).
STATE_PROPERTIES: Mapping[str, Callable[[spec.AllocatorState], bool]] = {
    name: INVARIANTS[name]
    for name in (
        "conservation",
        "partition",
        "duplicate_free_tables",
        "ref_counts",
        "tight_sizing",
        "keyed_by_request_id",
        "token_tracking",
        "cache_sound",
        "cached_content_exact",
        "salt_isolated",
        "shared_over_common_prefix",
        "grouped_consistently",
        "window_readable",
        "checkpoint_unwritten",
        "checkpoint_on_grid",
        "state_shared_only_by_forks",
    )
}

# What the target shows that the spec's state cannot hold, checked on the observation.
OBSERVATION_PROPERTIES: Mapping[str, str] = {
    "one_block_per_prefix": "a group caches each prefix in one block: a full block whose "
    "prefix is cached already is not cached again",
}

STEP_PROPERTIES: Mapping[str, str] = {
    "refusal_justified": "a step is refused only if the spec's operation, on the target's "
    "state before it, is refused too: fewer free and evictable blocks than it needs",
    "capacity_respected": "a step the spec refuses for want of blocks is not carried out",
    "spec_applicable": "the spec's operation applies to the target's state (it fails only "
    "on a state that already breaks a state property)",
    "raises_only_refusals": "a step the spec accepts raises nothing but a capacity refusal",
    "refusal_atomic": "a refused step changes nothing the target shows",
    "table_shape": "every table has the token count, skipped_blocks and length that the "
    "spec's operation gives; the same requests hold tables",
    "others_untouched": "a step on one request leaves every other request's tables as they were",
    "hit_confirmed": "every block a prompt hit reuses was cached for exactly that prefix of "
    "the prompt's tokens",
    "hit_maximal": "a hit is as long as the spec's hit rule finds in the target's own cache",
    "state_hit_exact": "a prompt hit of h tokens restores, in each recurrent state group, "
    "the state cached under exactly the prompt's first h tokens (copied into the "
    "request's running block), and no state for h = 0",
    "window_untouched": "no block that a query at or past L0 reads is released: "
    "skipped_blocks <= skipped_blocks_at(block_size, L0, W)",
    "exact_state": "(exact mode) free queue order, cached free queue order, tables, ref "
    "counts and cache equal the spec's",
    "spec_accepts": "(engine steps) every call the server makes is one the spec accepts "
    "(no unknown or duplicate request, no wrong kind of append)",
    "changes_accounted": "(engine steps) the pool changes only inside the allocator calls "
    "the adapter reports: what the target shows after one call is what it shows before "
    "the next",
}

ABSOLUTE_PROPERTIES: Mapping[str, str] = {
    "computed_findable": "after a step, every full block a call of the step computed (a "
    "table's block whose tokens are all known and all computed, in the group where it sits "
    "past skipped_blocks) is in the cache under its CacheKey: a prefix hit finds it",
    "eviction_justified": "a CacheKey leaves a cache only as the spec's operation on the "
    "same state evicts (BlockRemoved: a block was needed and the free queue was empty, or "
    "an append wrote into a block a rollback left cached) or on reset_prefix_cache: a call "
    "loses, over "
    "every group, at most as many keys as the spec's operation evicts",
    "shadow_hit_maximal": "a prompt's hit is at least the spec's hit rule "
    "(cached_prefix_tokens) over the kit's shadow: every key the target's calls computed "
    "or cached, less the keys it evicted as eviction_justified allows",
}

ADDING_OPERATIONS = frozenset({"allocate", "allocate_prompt", "append_tokens", "append_token_ids"})


@dataclass(frozen=True, slots=True)
class Finding:
    """A property that failed on a step: what the target gave and what the spec says, and
    the operation of the call that broke it (``None`` for a property of a whole step)."""

    name: str
    target: str
    spec: str
    operation: str | None = None


def state_findings(state: spec.AllocatorState, observes_ref_counts: bool) -> list[Finding]:
    """The state properties that ``state`` breaks."""
    broken = []
    for name, holds in STATE_PROPERTIES.items():
        if name == "ref_counts" and not observes_ref_counts:
            continue
        if not holds(state):
            broken.append(Finding(name, _describe(state), f"{name} holds"))
    return broken


@dataclass(frozen=True, slots=True)
class Expected:
    """What the spec's operation gives on the target's state before a step: the state after
    and the result, or the refusal's message."""

    state: spec.AllocatorState | None
    hit: int | None = None
    refusal: str | None = None
    error: str | None = None


def expected_step(
    before: spec.AllocatorState, operation: str, args: tuple[object, ...]
) -> Expected | None:
    """The spec's operation on ``before``; ``None`` when the spec does not accept the call at
    all (an unknown or duplicate request id, a count out of range): not a step to check.
    ``hit`` is an admission's prefix hit (``cached_prefix_tokens`` on ``before``)."""
    try:
        after = SPEC_OPERATIONS[operation](before, *args)
    except spec.BlockAllocationError as error:
        return Expected(None, refusal=str(error))
    except (KeyError, ValueError, TypeError):
        return None
    except Exception as error:  # a state outside the spec's own invariants: no oracle here
        return Expected(None, error=f"{type(error).__name__}: {error}")
    if operation != "allocate_prompt":
        return Expected(after)
    token_ids, cache_salt = args[1], args[2] if len(args) > 2 else None
    assert isinstance(token_ids, tuple) and (cache_salt is None or isinstance(cache_salt, str))
    return Expected(after, hit=spec.cached_prefix_tokens(before, token_ids, cache_salt))


def step_findings(
    *,
    operation: str,
    args: tuple[object, ...],
    before: spec.AllocatorState,
    after: spec.AllocatorState,
    outcome: Outcome,
    expected_step: Expected,
    exact: bool,
    cached_before: list[dict[int, spec.CacheKey]],
    target_after: Observation,
) -> list[Finding]:
    """The step properties that one step broke. ``cached_before[g]`` maps each block the
    target could find by a hit in group g before the step (target ids) to its key;
    ``target_after`` is what the target showed after it, in target ids."""
    expected, refusal = expected_step.state, expected_step.refusal
    findings: list[Finding] = []
    if expected_step.error is not None:
        findings.append(Finding("spec_applicable", expected_step.error, "the operation applies"))
        if outcome.refusal is None:
            findings += _others_findings(operation, args, before, after)
        elif _comparable(after) != _comparable(before):
            findings.append(Finding("refusal_atomic", _describe(after), _describe(before)))
        return findings
    if outcome.refusal is not None:
        if refusal is None:
            # A refusal that names its cause is declared apart (``adapter.REFUSAL_CAUSES``).
            cause = next((c for c in REFUSAL_CAUSES if outcome.refusal.startswith(c)), None)
            findings.append(
                Finding("refusal_justified", f"refused: {outcome.refusal}", "fits", cause)
            )
        if _comparable(after) != _comparable(before):
            findings.append(Finding("refusal_atomic", _describe(after), _describe(before)))
        return findings
    if refusal is not None or expected is None:
        findings.append(Finding("capacity_respected", "carried out", f"refused: {refusal}"))
        return findings
    findings += _shape_findings(after, expected)
    findings += _others_findings(operation, args, before, after)
    if operation == "allocate_prompt":
        assert expected_step.hit is not None
        findings += _hit_findings(
            args=args,
            outcome=outcome,
            expected=expected_step.hit,
            after=after,
            cached_before=cached_before,
            target_after=target_after,
        )
    if operation in ADDING_OPERATIONS:
        findings += _window_findings(operation, args, before, after, outcome)
    if exact and _comparable(after) != _comparable(expected):
        findings.append(Finding("exact_state", _describe(after), _describe(expected)))
    return findings


def target_operation_findings(
    operation: str,
    args: tuple[object, ...],
    before: spec.AllocatorState,
    after: spec.AllocatorState,
) -> list[Finding]:
    """The step properties of a call that is none of the spec's operations
    (``TARGET_OPERATIONS``): ``cache_blocks(r)`` may change which block holds a prefix in
    r's table (a block computed twice is swapped for the one already caching it) but not its
    shape, nor any other table; ``evict()`` and ``take_copies(r)`` change no table at all."""
    acting = {args[0]} if operation == "cache_blocks" else set()
    findings = _shape_findings(after, before)
    for group, (old, new) in enumerate(zip(before.group_tables, after.group_tables, strict=True)):
        for request_id, table in old.items():
            if request_id not in acting and new.get(request_id) != table:
                findings.append(
                    Finding("others_untouched", f"group {group}: {new.get(request_id)}", f"{table}")
                )
                return findings
    return findings


def _shape_findings(after: spec.AllocatorState, expected: spec.AllocatorState) -> list[Finding]:
    def shapes(state: spec.AllocatorState) -> list[dict[str, tuple[int, int, int]]]:
        return [
            {r: (t.token_count, t.skipped_blocks, len(t.block_ids)) for r, t in tables.items()}
            for tables in state.group_tables
        ]

    got, want = shapes(after), shapes(expected)
    if got == want:
        return []
    return [Finding("table_shape", _shape_text(got), _shape_text(want))]


def _others_findings(
    operation: str,
    args: tuple[object, ...],
    before: spec.AllocatorState,
    after: spec.AllocatorState,
) -> list[Finding]:
    acting = {args[1]} if operation == "fork" else {args[0]}
    for group, (old, new) in enumerate(zip(before.group_tables, after.group_tables, strict=True)):
        for request_id, table in old.items():
            if request_id in acting:
                continue
            now = new.get(request_id)
            if now != table:
                return [Finding("others_untouched", f"group {group}: {now}", f"{table}")]
    return []


def _hit_findings(
    *,
    args: tuple[object, ...],
    outcome: Outcome,
    expected: int,
    after: spec.AllocatorState,
    cached_before: list[dict[int, spec.CacheKey]],
    target_after: Observation,
) -> list[Finding]:
    request_id, token_ids = args[0], args[1]
    cache_salt = args[2] if len(args) > 2 else None
    assert isinstance(request_id, str) and isinstance(token_ids, tuple)
    assert cache_salt is None or isinstance(cache_salt, str)
    hit = outcome.result
    findings = []
    if hit != expected:
        findings.append(Finding("hit_maximal", f"hit {hit} tokens", f"hit {expected} tokens"))
    if not isinstance(hit, int):
        return findings
    block_size = after.block_size
    findings += _state_hit_findings(
        request_id=request_id,
        hit=hit,
        prefix=spec.CacheKey(cache_salt, token_ids[:hit]),
        after=after,
        cached_before=cached_before,
        target_after=target_after,
    )
    for group, tables in enumerate(target_after.tables):
        if isinstance(after.group_windows[group], spec.RecurrentState):
            continue  # one running block: _state_hit_findings
        skipped = after.group_tables[group][request_id].skipped_blocks
        for index in range(skipped, hit // block_size):
            block_id = tables[request_id].block_ids[index - skipped]
            prefix = spec.CacheKey(cache_salt, token_ids[: (index + 1) * block_size])
            if cached_before[group].get(block_id) != prefix:
                findings.append(
                    Finding(
                        "hit_confirmed",
                        f"group {group} block index {index}: block {block_id} holding "
                        f"{cached_before[group].get(block_id)}",
                        f"a block cached for {prefix}",
                    )
                )
                return findings
    return findings


def _state_hit_findings(
    *,
    request_id: str,
    hit: int,
    prefix: spec.CacheKey,
    after: spec.AllocatorState,
    cached_before: list[dict[int, spec.CacheKey]],
    target_after: Observation,
) -> list[Finding]:
    """``state_hit_exact``: ``spec.invariants.is_state_hit_exact``'s rule in target ids, read
    over every block the target cached (a target may cache a prefix twice and restore
    either copy): a hit of h > 0 tokens copies into the request's running block a state
    cached under exactly the prompt's first h tokens; a hit of 0 copies none."""
    sources = {destination: source for source, destination in target_after.pending_copies}
    for group, kind in enumerate(after.group_windows):
        if not isinstance(kind, spec.RecurrentState):
            continue
        (running,) = target_after.tables[group][request_id].block_ids
        source = sources.get(running)
        if hit == 0 and source is None:
            continue
        restored = None if source is None else cached_before[group].get(source)
        if hit == 0 or restored != prefix:
            return [
                Finding(
                    "state_hit_exact",
                    f"hit {hit} tokens, group {group} restores block {source} holding {restored}",
                    f"the state cached under {prefix}" if hit else "no state (a fresh block)",
                )
            ]
    return []


def _window_findings(
    operation: str,
    args: tuple[object, ...],
    before: spec.AllocatorState,
    after: spec.AllocatorState,
    outcome: Outcome,
) -> list[Finding]:
    request_id = args[0]
    assert isinstance(request_id, str)
    if operation == "allocate_prompt":
        computed_tokens = outcome.result if isinstance(outcome.result, int) else 0
    elif operation == "allocate":
        computed_tokens = 0
    else:
        computed_tokens = before.tables[request_id].token_count
    for group, kind in enumerate(after.group_windows):
        # Full attention and a state group skip nothing: allowed is 0 there.
        allowed = kind.skipped_blocks_at(after.block_size, computed_tokens)
        skipped = after.group_tables[group][request_id].skipped_blocks
        if skipped > allowed:
            return [
                Finding(
                    "window_untouched",
                    f"group {group} (W={kind.window}) skipped {skipped} blocks at "
                    f"L0={computed_tokens}",
                    f"at most {allowed}",
                )
            ]
    return []


def _comparable(state: spec.AllocatorState) -> tuple[object, ...]:
    return (
        state.free_block_ids,
        state.cached_free_block_ids,
        state.group_tables,
        state.ref_counts,
        state.group_caches,
    )


def _shape_text(shapes: list[dict[str, tuple[int, int, int]]]) -> str:
    return "; ".join(
        f"group {g}: "
        + ", ".join(f"{r} tokens={c} skipped={s} blocks={n}" for r, (c, s, n) in sorted(t.items()))
        for g, t in enumerate(shapes)
    )


def _describe(state: spec.AllocatorState) -> str:
    tables = "; ".join(
        f"group {g}: "
        + ", ".join(
            f"{r}={list(t.block_ids)}"
            + (f"+{t.skipped_blocks} skipped" if t.skipped_blocks else "")
            + f"/{t.token_count}t"
            for r, t in sorted(tables.items())
        )
        for g, tables in enumerate(state.group_tables)
    )
    return (
        f"free={list(state.free_block_ids)} cached_free={list(state.cached_free_block_ids)} "
        f"tables[{tables}] ref_counts={dict(sorted(state.ref_counts.items()))} "
        f"cache={[sorted(cache.values()) for cache in state.group_caches]}"
    )
