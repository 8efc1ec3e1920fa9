"""The conformance state machine: random steps on a target, each judged against the spec.

``machine_for(factory)`` builds a Hypothesis ``RuleBasedStateMachine`` for the adapter that
``factory`` makes. Each rule draws one of the spec's operations (only those the adapter
supports, only calls the spec accepts on the target's current state), applies it to the
target, and checks every property of ``harness.conformance.properties``. A broken property
the adapter does not declare as a difference raises ``DiscrepancyError`` with the steps of the
run; Hypothesis then shrinks the run to the shortest that still breaks it. Declared
differences are counted, not raised.

Not here: how many steps run, the seed, the report (``harness.conformance.run``).
"""

from collections import Counter
from collections.abc import Callable
from typing import ClassVar, cast

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import spec
from harness.conformance.adapter import CACHE_SALT, KV_EVENTS, Adapter, Observation
from harness.conformance.events import EventJudge, EventSource
from harness.conformance.properties import (
    Finding,
    Outcome,
    expected_step,
    state_findings,
    step_findings,
)
from harness.conformance.report import DiscrepancyError, StepRecord
from harness.conformance.view import Bijection, Contents, duplicate_cached_blocks, to_state

REQUEST_IDS = ("r0", "r1", "r2", "r3", "r4")
PICKS = st.integers(0, len(REQUEST_IDS) - 1)
# Prompts from a 4-token vocabulary, most starting with a shared prefix, so prefix hits and
# duplicate full blocks are frequent.
SHARED_PREFIXES = [(), (1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 2, 3, 0, 0, 1), (2,) * 6]
PROMPTS = st.builds(
    lambda prefix, suffix: prefix + suffix,
    st.sampled_from(SHARED_PREFIXES),
    st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple),
)
# Cache salts for an adapter that takes them: no salt half the time, two tenants. Not the
# empty salt: vLLM's API refuses one and its hasher takes it for none (docs/conformance.md
# finding 7); pagedkv's own lockstep covers it.
CACHE_SALTS = st.sampled_from([None, None, "a", "b"])
NEW_TOKEN_IDS = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)
TOKEN_COUNTS = st.integers(1, 12)


class Tally:
    """Steps and test cases run, and declared differences seen, across a run's machines."""

    def __init__(self) -> None:
        self.steps = 0
        self.cases = 0
        self.declared: Counter[str] = Counter()
        self.on_case: Callable[[], None] = lambda: None


class ConformanceMachine(RuleBasedStateMachine):
    """The machine for one adapter factory; ``machine_for`` sets the class attributes."""

    factory: ClassVar[Callable[[], Adapter]]
    tally: ClassVar[Tally]

    def __init__(self) -> None:
        super().__init__()
        self.adapter = type(self).factory()
        self.bijection = Bijection(self.adapter.pool_block_ids)
        self.contents = Contents(len(self.adapter.group_windows))
        self.token_ids: dict[str, tuple[int, ...]] = {}
        self.cache_salts: dict[str, str] = {}
        self.steps: list[StepRecord] = []
        self.observation = self.adapter.observe()
        self.state = self._view(self.observation)
        self._judge([*state_findings(self.state, self._observes_ref_counts)], None)
        self.events = EventJudge(self.adapter.block_size)

    # -- rules: one per operation the spec names ------------------------------------------
    # A step names a live request by its rank among the live ones (``pick``), and a new
    # request gets the first free id of five, so every drawn step is a call the spec
    # accepts and shrinking deletes steps freely.

    @precondition(lambda self: "allocate_prompt" in self.adapter.supports and self._has_room)
    @rule(token_ids=PROMPTS, cache_salt=CACHE_SALTS)
    def allocate_prompt(self, token_ids: tuple[int, ...], cache_salt: str | None) -> None:
        if CACHE_SALT in self.adapter.supports:
            self._step("allocate_prompt", self._new_id(), token_ids, cache_salt)
        else:
            self._step("allocate_prompt", self._new_id(), token_ids)

    @precondition(lambda self: "allocate" in self.adapter.supports and self._has_room)
    @rule(token_count=TOKEN_COUNTS)
    def allocate(self, token_count: int) -> None:
        self._step("allocate", self._new_id(), token_count)

    @precondition(lambda self: "append_token_ids" in self.adapter.supports and self._live)
    @rule(pick=PICKS, token_ids=NEW_TOKEN_IDS)
    def append_token_ids(self, pick: int, token_ids: tuple[int, ...]) -> None:
        self._step("append_token_ids", self._pick(pick), token_ids)

    @precondition(lambda self: "append_tokens" in self.adapter.supports and self._live)
    @rule(pick=PICKS, token_count=TOKEN_COUNTS)
    def append_tokens(self, pick: int, token_count: int) -> None:
        self._step("append_tokens", self._pick(pick), token_count)

    @precondition(lambda self: "fork" in self.adapter.supports and self._live and self._has_room)
    @rule(pick=PICKS)
    def fork(self, pick: int) -> None:
        self._step("fork", self._pick(pick), self._new_id())

    @precondition(lambda self: "release" in self.adapter.supports and self._live)
    @rule(pick=PICKS)
    def release(self, pick: int) -> None:
        self._step("release", self._pick(pick))

    @precondition(lambda self: "preempt" in self.adapter.supports and self._live)
    @rule(pick=PICKS)
    def preempt(self, pick: int) -> None:
        self._step("preempt", self._pick(pick))

    @precondition(lambda self: "truncate" in self.adapter.supports and self._live)
    @rule(pick=PICKS, drop=st.integers(0, 12))
    def truncate(self, pick: int, drop: int) -> None:
        request_id = self._pick(pick)
        count = self.state.tables[request_id].token_count
        self._step("truncate", request_id, max(0, count - drop))

    @property
    def _live(self) -> list[str]:
        return sorted(self.state.tables)

    @property
    def _has_room(self) -> bool:
        return len(self.state.tables) < len(REQUEST_IDS)

    def _pick(self, pick: int) -> str:
        live = self._live
        return live[pick % len(live)]

    def _new_id(self) -> str:
        return next(r for r in REQUEST_IDS if r not in self.state.tables)

    def teardown(self) -> None:
        type(self).tally.cases += 1
        type(self).tally.on_case()

    # -- one step -------------------------------------------------------------------------

    def _step(self, operation: str, *args: object) -> bool:
        """Apply one step to the target and judge it; whether the target carried it out."""
        before = self.state
        expected = expected_step(before, operation, args)
        if expected is None:
            return False  # a call the spec refuses outright (a wrong kind of append): skip
        cached_before = self._cached_prefixes(self.observation)
        raised: list[Finding] = []
        try:
            outcome = Outcome(result=getattr(self.adapter, operation)(*args))
        except spec.BlockAllocationError as error:
            outcome = Outcome(refusal=str(error))
        except Exception as error:  # the target's own failure: a finding, then shrunk
            outcome = Outcome(refusal=f"{type(error).__name__}: {error}")
            raised.append(Finding("raises_only_refusals", str(error), "no exception"))
        if outcome.refusal is None:
            self._track_tokens(operation, args)
        self.observation = self.adapter.observe()
        self.contents.learn(
            self.observation, self.token_ids, self.adapter.block_size, self.cache_salts
        )
        self.state = self._view(self.observation)
        findings = raised + state_findings(self.state, self._observes_ref_counts)
        if KV_EVENTS in self.adapter.supports:
            events = cast(EventSource, self.adapter).take_events()
            findings += self.events.judge(events, self.state, f"{operation}{args}")
        duplicates = duplicate_cached_blocks(self.observation, self.contents)
        if duplicates:
            findings.append(
                Finding(
                    "one_block_per_prefix", f"blocks {duplicates} cache a cached prefix", "none"
                )
            )
        findings += step_findings(
            operation=operation,
            args=args,
            before=before,
            after=self.state,
            outcome=outcome,
            expected_step=expected,
            exact=self.adapter.exact,
            cached_before=cached_before,
            target_tables_after=[
                {r: t.block_ids for r, t in tables.items()} for tables in self.observation.tables
            ],
        )
        type(self).tally.steps += 1
        self.steps.append(StepRecord(operation, args, outcome, expected))
        self._judge(findings, operation)
        return outcome.refusal is None

    def _judge(self, findings: list[Finding], operation: str | None) -> None:
        tally = type(self).tally
        differences = self.adapter.differences
        bugs = []
        for finding in findings:
            if finding.name in differences or f"{finding.name}/{operation}" in differences:
                tally.declared[finding.name] += 1
            else:
                bugs.append(finding)
        if bugs:
            raise DiscrepancyError(
                self.adapter.name, self.steps, findings, differences, self.bijection
            )

    # -- the spec-side model --------------------------------------------------------------

    @property
    def _observes_ref_counts(self) -> bool:
        return self.observation.ref_counts is not None

    def _view(self, observation: Observation) -> spec.AllocatorState:
        return to_state(
            observation,
            block_size=self.adapter.block_size,
            group_windows=self.adapter.group_windows,
            bijection=self.bijection,
            contents=self.contents,
            token_ids=self.token_ids,
            cache_salts=self.cache_salts,
        )

    def _cached_prefixes(self, observation: Observation) -> list[dict[int, spec.CacheKey]]:
        found: list[dict[int, spec.CacheKey]] = []
        for group, cached in enumerate(observation.cached_block_ids):
            keys = {}
            for block_id in cached:
                key = self.contents.key(group, block_id)
                if key is not None:
                    keys[block_id] = key
            found.append(keys)
        found += [{} for _ in range(len(self.adapter.group_windows) - len(found))]
        return found

    def _track_tokens(self, operation: str, args: tuple[object, ...]) -> None:
        """Keep the token ids and the salt of every request that tracks them, as the spec
        does (a fork keeps its parent's salt)."""
        request_id = args[0]
        assert isinstance(request_id, str)
        if operation == "allocate_prompt":
            assert isinstance(args[1], tuple)
            self.token_ids[request_id] = args[1]
            if len(args) > 2 and isinstance(args[2], str):
                self.cache_salts[request_id] = args[2]
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


def machine_for(
    factory: Callable[[], Adapter], tally: Tally | None = None
) -> type[ConformanceMachine]:
    """A conformance machine class for the adapters ``factory`` makes; run it with
    ``machine_for(factory).TestCase`` under pytest, or through ``harness.conformance.run``."""
    return type(
        "ConformanceMachine",
        (ConformanceMachine,),
        {"factory": staticmethod(factory), "tally": tally or Tally()},
    )
