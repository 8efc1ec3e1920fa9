"""The kit's model of one target and the judgement of each step against the spec.

A ``Judge`` keeps what the kit knows of the target between steps (the bijection of block
ids, each block's content, each request's tokens and salt, the shadow) and judges a step:
one call for an adapter driven operation by operation, every allocator call of an engine
step for an engine adapter. Each call is judged on the observations around it (the state
properties after it, the step properties against the spec's operation on the state before
it); the step as a whole is judged by the absolute properties (``shadow``) and, for a
target that supports ``KV_EVENTS``, by the KV cache events it emitted
(``harness.conformance.events``). Findings the
target does not declare as differences raise ``DiscrepancyError``; declared ones are counted.

Not here: which steps run (``harness.conformance.machine``).
"""

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import cast

import spec
from harness.conformance.adapter import (
    KV_EVENTS,
    TARGET_OPERATIONS,
    Adapter,
    Call,
    EngineAdapter,
    Observation,
)
from harness.conformance.events import EventJudge, EventSource
from harness.conformance.properties import (
    ADDING_OPERATIONS,
    Expected,
    Finding,
    expected_step,
    state_findings,
    step_findings,
    target_operation_findings,
)
from harness.conformance.report import CallRecord, DiscrepancyError, StepRecord, declared_reason
from harness.conformance.shadow import (
    Shadow,
    computed_keys,
    evicted_counts,
    eviction_findings,
    extra_state_blocks,
    revived_counts,
    visible_keys,
)
from harness.conformance.validate import AdapterError, blamed_on_adapter, observed
from harness.conformance.view import Bijection, Contents, duplicate_cached_blocks, to_state
from spec.kinds import group_kinds


class Tally:
    """Steps and test cases run, declared differences seen and the adapter's last fault,
    across a run's machines; ``on_progress`` is called after every step and every test case."""

    def __init__(self) -> None:
        self.steps = 0
        self.cases = 0
        self.declared: Counter[str] = Counter()
        self.on_progress: Callable[[], None] = lambda: None
        self.fault: AdapterError | None = None

    @contextlib.contextmanager
    def adapter_faults(self) -> Iterator[None]:
        """Keep the ``AdapterError`` raised inside as ``fault``. NOTE: an adapter that fails
        on one run of a test case and not on its replay (a factory that runs out of
        something) makes Hypothesis raise its own ``Flaky*`` error, without the fault."""
        try:
            yield
        except AdapterError as error:
            self.fault = error
            raise


class Judge:
    """The kit's model of ``adapter``'s target, and the judge of its steps."""

    def __init__(self, adapter: Adapter | EngineAdapter, tally: Tally) -> None:
        self.adapter = adapter
        self.tally = tally
        self.exact = bool(getattr(adapter, "exact", False))
        self.groups = len(adapter.group_windows)
        self.bijection = Bijection(adapter.pool_block_ids)
        self.kinds = group_kinds(adapter.group_windows, adapter.block_size, 0)
        state_groups = frozenset(
            g for g, kind in enumerate(self.kinds) if isinstance(kind, spec.RecurrentState)
        )
        self.contents = Contents(self.groups, state_groups)
        self.shadow = Shadow(self.groups)
        self.token_ids: dict[str, tuple[int, ...]] = {}
        self.cache_salts: dict[str, str] = {}
        self.steps: list[StepRecord] = []
        # The target's KV cache events, judged after every step (harness.conformance.events).
        self.events = EventJudge(adapter.block_size) if KV_EVENTS in adapter.supports else None
        # The last view: an engine step's calls observe the pool between them twice (after
        # one, before the next), and the kit's knowledge changes only when it learns.
        self._viewed: tuple[Observation, int, spec.AllocatorState] | None = None
        self._learned = 0
        self.observation = observed(adapter, "on a fresh adapter")
        self.state = self.view(self.observation)
        self.raise_bugs(state_findings(self.state, self.observes_ref_counts))

    @property
    def observes_ref_counts(self) -> bool:
        return self.observation.ref_counts is not None

    def view(self, observation: Observation) -> spec.AllocatorState:
        """``observation`` as the spec state it is, under what the kit knows now."""
        if self._viewed is not None:
            seen, learned, state = self._viewed
            if learned == self._learned and seen == observation:
                return state
        state = to_state(
            observation,
            block_size=self.adapter.block_size,
            group_windows=self.kinds,
            bijection=self.bijection,
            contents=self.contents,
            token_ids=self.token_ids,
            cache_salts=self.cache_salts,
        )
        self._viewed = (observation, self._learned, state)
        return state

    # -- a step -----------------------------------------------------------------------------

    def judge_step(
        self, label: str, calls: list[Call], final: Observation, raised: str | None = None
    ) -> None:
        """Judge a step made of ``calls`` that left the target showing ``final``; record it,
        and raise ``DiscrepancyError`` if it broke a property the target does not declare."""
        findings: list[Finding] = []
        if raised is not None:
            findings.append(Finding("raises_only_refusals", raised, "no exception"))
        computed: list[dict[spec.CacheKey, str]] = [{} for _ in range(self.groups)]
        released: set[str] = set()
        evicted: list[frozenset[spec.CacheKey]] = [frozenset() for _ in range(self.groups)]
        records = []
        previous = self.observation
        for call in calls:
            if call.before != previous:
                findings.append(_unaccounted(previous, call.before, call.operation))
            call_findings, expected, call_evicted = self._judge_call(call)
            findings += call_findings
            evicted = [keys | more for keys, more in zip(evicted, call_evicted, strict=True)]
            records.append(CallRecord(call.operation, call.args, call.outcome, expected))
            if call.operation in ADDING_OPERATIONS and call.outcome.refusal is None:
                request_id = call.args[0]
                assert isinstance(request_id, str)
                before_table = call.before.tables[0].get(request_id)
                start = 0 if before_table is None else before_table.token_count
                for group, keys in enumerate(computed_keys(self.state, request_id, start)):
                    computed[group].update(dict.fromkeys(keys, request_id))
            if call.operation in ("release", "preempt"):
                released.add(str(call.args[0]))
            previous = call.after
        if final != previous:
            findings.append(_unaccounted(previous, final, None))
        self.observation = final
        self._learn(final)
        self.state = self.view(final)
        if not calls:
            findings += state_findings(self.state, self.observes_ref_counts)
        if self.events is not None:
            with (
                self.tally.adapter_faults(),
                blamed_on_adapter(self.adapter, "take_events()", f"after {label}"),
            ):
                events = cast(EventSource, self.adapter).take_events()
            findings += self.events.judge(events, self.state, label)
        findings += self.shadow.settle(
            visible_after=visible_keys(final, self.contents, self.groups),
            computed=computed,
            released=released,
            evicted=evicted,
            contents=self.contents,
        )
        self.tally.steps += 1
        self.steps.append(StepRecord(label, tuple(records)))
        self.raise_bugs(findings)
        self.tally.on_progress()

    def raise_bugs(self, findings: list[Finding]) -> None:
        differences = self.adapter.differences
        bugs = []
        for finding in findings:
            if declared_reason(finding, differences):
                # Counted under the key that declared it: a property, or property/operation.
                key = finding.name if finding.name in differences else None
                self.tally.declared[key or f"{finding.name}/{finding.operation}"] += 1
            else:
                bugs.append(finding)
        if bugs:
            raise DiscrepancyError(
                self.adapter.name, self.steps, findings, differences, self.bijection
            )

    # -- a call -----------------------------------------------------------------------------

    def _judge_call(
        self, call: Call
    ) -> tuple[list[Finding], Expected | None, list[frozenset[spec.CacheKey]]]:
        """One call's findings, the spec's side of it, and the keys it evicted."""
        operation, args, outcome = call.operation, call.args, call.outcome
        before = self.view(call.before)
        visible_before = visible_keys(call.before, self.contents, self.groups)
        spare = self._spare_duplicates(call.before)
        expected = (
            None if operation in TARGET_OPERATIONS else expected_step(before, operation, args)
        )
        cached_before = self._cached_prefixes(call.before)
        shadow_hit = None
        if operation == "allocate_prompt":
            token_ids, cache_salt = args[1], args[2] if len(args) > 2 else None
            assert isinstance(token_ids, tuple)
            assert cache_salt is None or isinstance(cache_salt, str)
            shadow_hit = self.shadow.hit(
                before, token_ids, cache_salt, visible_before, self.contents
            )
        self._track_tokens(call)
        self._learn(call.after)
        after = self.state = self.view(call.after)
        findings = state_findings(after, call.after.ref_counts is not None)
        duplicates = duplicate_cached_blocks(call.after, self.contents)
        if duplicates:
            findings.append(
                Finding(
                    "one_block_per_prefix", f"blocks {duplicates} cache a cached prefix", "none"
                )
            )
        if operation in TARGET_OPERATIONS:
            findings += target_operation_findings(operation, args, before, after)
        elif expected is None:
            findings.append(Finding("spec_accepts", _call_text(call), "a call the spec accepts"))
        else:
            findings += step_findings(
                operation=operation,
                args=args,
                before=before,
                after=after,
                outcome=outcome,
                expected_step=expected,
                exact=self.exact,
                cached_before=cached_before,
                target_after=call.after,
            )
        hit = outcome.result
        if shadow_hit is not None and isinstance(hit, int) and hit < shadow_hit:
            findings.append(
                Finding("shadow_hit_maximal", f"hit {hit} tokens", f"hit {shadow_hit} tokens")
            )
        if expected is not None and expected.refusal is not None and outcome.refusal is None:
            allowed = revived_counts(call.before, call.after)  # done where the spec refuses
        else:
            events = expected.state.events if expected is not None and expected.state else ()
            allowed = evicted_counts(events, self.groups)
            if expected is not None and expected.state is not None and args:
                extra = extra_state_blocks(before, after, expected.state, str(args[0]))
                allowed = [a + b for a, b in zip(allowed, extra, strict=True)]
        eviction, evicted = eviction_findings(
            visible_before, visible_keys(call.after, self.contents, self.groups), allowed, spare
        )
        return [_tagged(f, operation) for f in findings + eviction], expected, evicted

    def _spare_duplicates(self, observation: Observation) -> int:
        """The cached free blocks whose key another cached block of their group holds too."""
        duplicates = set(duplicate_cached_blocks(observation, self.contents))
        return len(duplicates & set(observation.cached_free_block_ids))

    def _learn(self, observation: Observation) -> None:
        self._learned += 1
        self.contents.learn(observation, self.token_ids, self.adapter.block_size, self.cache_salts)

    def _cached_prefixes(self, observation: Observation) -> list[dict[int, spec.CacheKey]]:
        found: list[dict[int, spec.CacheKey]] = []
        for group, cached in enumerate(observation.cached_block_ids):
            keys = {}
            for block_id in cached:
                key = self.contents.key(group, block_id)
                if key is not None:
                    keys[block_id] = key
            found.append(keys)
        found += [{} for _ in range(self.groups - len(found))]
        return found

    def _track_tokens(self, call: Call) -> None:
        """Keep the token ids and the salt of every request that tracks them, as the spec
        does (a fork keeps its parent's salt). A refused admission that still left the
        request holding blocks (a declared non-atomic refusal) holds the tokens its
        table covers."""
        operation, args = call.operation, call.args
        self._learned += 1
        if operation in TARGET_OPERATIONS:
            return
        request_id = args[0]
        assert isinstance(request_id, str)
        if call.outcome.refusal is not None:
            table = call.after.tables[0].get(request_id) if call.after.tables else None
            if operation == "allocate_prompt" and table is not None:
                assert isinstance(args[1], tuple)
                self._admit(request_id, args[1][: table.token_count], args)
            return
        if operation == "allocate_prompt":
            assert isinstance(args[1], tuple)
            self._admit(request_id, args[1], args)
        elif operation == "append_token_ids" and request_id in self.token_ids:
            assert isinstance(args[1], tuple)
            self.token_ids[request_id] += args[1]
        elif operation == "fork" and request_id in self.token_ids:
            assert isinstance(args[1], str)
            self.token_ids[args[1]] = self.token_ids[request_id]
            if request_id in self.cache_salts:
                self.cache_salts[args[1]] = self.cache_salts[request_id]
        elif operation == "truncate" and request_id in self.token_ids:
            assert isinstance(args[1], int)
            self.token_ids[request_id] = self.token_ids[request_id][: args[1]]
        elif operation in ("release", "preempt"):
            self.token_ids.pop(request_id, None)
            self.cache_salts.pop(request_id, None)

    def _admit(self, request_id: str, token_ids: tuple[int, ...], args: tuple[object, ...]) -> None:
        self.token_ids[request_id] = token_ids
        if len(args) > 2 and isinstance(args[2], str):
            self.cache_salts[request_id] = args[2]


def _tagged(finding: Finding, operation: str) -> Finding:
    if finding.operation is not None:
        return finding
    return Finding(finding.name, finding.target, finding.spec, operation)


def _call_text(call: Call) -> str:
    return f"{call.operation}({', '.join(repr(arg) for arg in call.args)})"


def _unaccounted(shown: Observation, now: Observation, next_operation: str | None) -> Finding:
    where = f"before {next_operation}" if next_operation else "at the end of the step"
    return Finding(
        "changes_accounted",
        f"the pool changed between two calls ({where}): free {list(shown.free_block_ids)} -> "
        f"{list(now.free_block_ids)}, tables {_tables(shown)} -> {_tables(now)}",
        "no change outside a call",
    )


def _tables(observation: Observation) -> str:
    return "; ".join(
        ", ".join(f"{r}={list(t.block_ids)}" for r, t in sorted(tables.items()))
        for tables in observation.tables
    )
