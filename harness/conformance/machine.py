"""The conformance state machines: random steps on a target, each judged against the spec.

``machine_for(factory)`` builds a Hypothesis ``RuleBasedStateMachine`` for the adapters
``factory`` makes. For an ``Adapter`` each rule draws one of the spec's operations (only
those it supports, only calls the spec accepts on the target's current state) and applies
it; for an ``EngineAdapter`` the rules are a server's: a request arrives, an engine step
runs (the stub model's sampled tokens and which requests finish are drawn), a client
aborts. ``harness.conformance.judge`` judges each step; a broken property the adapter does
not declare raises ``DiscrepancyError`` with the steps of the run, and Hypothesis shrinks
the run to the shortest that still breaks it.

Not here: how many steps run, the seed, the report (``harness.conformance.run``).
"""

from collections.abc import Callable
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import spec
from harness.conformance.adapter import (
    CACHE_SALT,
    Adapter,
    Call,
    EngineAdapter,
    Observation,
    Outcome,
    ServerError,
    is_engine,
)
from harness.conformance.judge import Judge, Tally
from harness.conformance.properties import expected_step
from harness.conformance.validate import AdapterError, made, observed
from harness.named_callables import one_line

REQUEST_IDS = ("r0", "r1", "r2", "r3", "r4")
PICKS = st.integers(0, len(REQUEST_IDS) - 1)
# Prompts from a 4-token vocabulary, most starting with a shared prefix, so prefix hits and
# duplicate full blocks are frequent; a shared prefix alone (no suffix) is a prompt too, so
# the same prompt arrives again, and one 8 tokens long (a whole number of blocks) is the
# case where only the last token keeps a hit short of the whole prompt.
SHARED_PREFIXES = [(), (1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 2, 3, 0, 0, 1), (2,) * 6]
PROMPTS = st.builds(
    lambda prefix, suffix: prefix + suffix,
    st.sampled_from(SHARED_PREFIXES),
    st.lists(st.integers(0, 3), min_size=0, max_size=6).map(tuple),
).filter(bool)
# Cache salts for an adapter that takes them: no salt half the time, two tenants. Not the
# empty salt: vLLM's API refuses one and its hasher takes it for none (docs/conformance.md,
# "Declared differences"); pagedkv's own lockstep covers it.
CACHE_SALTS = st.sampled_from([None, None, "a", "b"])
NEW_TOKEN_IDS = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)
TOKEN_COUNTS = st.integers(1, 12)
# An engine step: the token the stub model samples for each request slot (the base-4 digits
# of one number: one draw a step, shrinking to all zeros), and the requests whose token
# this step is a stop token.
SAMPLED = st.integers(0, 4 ** len(REQUEST_IDS) - 1)
FINISHING = st.frozensets(st.sampled_from(REQUEST_IDS), max_size=2)
# A request this long finishes at its next token, so that one request alone always fits a
# pool of 12 blocks of 4 tokens.
MAX_REQUEST_TOKENS = 32


class ConformanceMachine(RuleBasedStateMachine):
    """What both machines share: the adapter, its judge, the tally of cases."""

    factory: ClassVar[Callable[[], Adapter | EngineAdapter]]
    tally: ClassVar[Tally]

    def __init__(self) -> None:
        super().__init__()
        with type(self).tally.adapter_faults():
            self.judge = Judge(made(type(self).factory), type(self).tally)

    def teardown(self) -> None:
        type(self).tally.cases += 1
        type(self).tally.on_progress()

    def observed_after(self, label: str) -> Observation:
        """What the adapter shows after step ``label``; its fault if it cannot show it."""
        with self.judge.tally.adapter_faults():
            return observed(self.judge.adapter, f"after {self.step_text}, {label}")

    @property
    def step_text(self) -> str:
        return f"step {len(self.judge.steps) + 1} of a test case"


class OperationMachine(ConformanceMachine):
    """The machine for an ``Adapter``, one operation a step."""

    adapter: Adapter

    def __init__(self) -> None:
        super().__init__()
        target = self.judge.adapter
        assert not is_engine(target)
        self.adapter = target  # type: ignore[assignment]

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
        count = self.judge.state.tables[request_id].token_count
        self._step("truncate", request_id, max(0, count - drop))

    @property
    def _live(self) -> list[str]:
        return sorted(self.judge.state.tables)

    @property
    def _has_room(self) -> bool:
        return len(self.judge.state.tables) < len(REQUEST_IDS)

    def _pick(self, pick: int) -> str:
        live = self._live
        return live[pick % len(live)]

    def _new_id(self) -> str:
        return next(r for r in REQUEST_IDS if r not in self.judge.state.tables)

    def _step(self, operation: str, *args: object) -> None:
        """Apply one operation to the target and judge it."""
        if expected_step(self.judge.state, operation, args) is None:
            return  # a call the spec refuses outright (a wrong kind of append): skip
        before = self.judge.observation
        raised = None
        try:
            outcome = Outcome(result=getattr(self.adapter, operation)(*args))
        except spec.BlockAllocationError as error:
            outcome = Outcome(refusal=str(error))
        except Exception as error:  # the target's own failure: a finding, then shrunk
            outcome = Outcome(refusal=f"{type(error).__name__}: {error}")
            raised = f"{type(error).__name__}: {error}"
        label = _text(operation, args)
        after = self.observed_after(label)
        call = Call(operation, args, outcome, before, after)
        self.judge.judge_step(label, [call], after, raised)


class EngineMachine(ConformanceMachine):
    """The machine for an ``EngineAdapter``: arrivals, engine steps, aborts."""

    adapter: EngineAdapter

    def __init__(self) -> None:
        super().__init__()
        target = self.judge.adapter
        assert is_engine(target)
        self.adapter = target  # type: ignore[assignment]
        self.waiting_or_running: list[str] = []

    @precondition(lambda self: len(self.waiting_or_running) < len(REQUEST_IDS))
    @rule(token_ids=PROMPTS, cache_salt=CACHE_SALTS)
    def arrive(self, token_ids: tuple[int, ...], cache_salt: str | None) -> None:
        request_id = next(r for r in REQUEST_IDS if r not in self.waiting_or_running)
        salt = cache_salt if CACHE_SALT in self.adapter.supports else None
        raised = None
        try:
            self.adapter.submit(request_id, token_ids, salt)
        except Exception as error:  # the server refused the arrival: a finding, then shrunk
            raised = f"{type(error).__name__}: {error}"
        else:
            self.waiting_or_running.append(request_id)
        # A step of its own in the report (no allocator call: the pool must not change).
        label = f"arrive({request_id!r}, {token_ids!r}, {salt!r})"
        self.judge.judge_step(label, [], self.observed_after(label), raised)

    @precondition(lambda self: self.waiting_or_running)
    @rule(sampled=SAMPLED, finishing=FINISHING)
    def step(self, sampled: int, finishing: frozenset[str]) -> None:
        tokens = {r: sampled // 4**slot % 4 for slot, r in enumerate(REQUEST_IDS)}
        long = {r for r, ids in self.judge.token_ids.items() if len(ids) + 1 >= MAX_REQUEST_TOKENS}
        ending = frozenset((finishing | long) & set(self.waiting_or_running))
        label = f"step(sampled={[tokens[r] for r in self.waiting_or_running]}, " + (
            f"finishing={sorted(ending)})"
        )
        self._run(label, lambda: self.adapter.step(tokens, ending))

    @precondition(lambda self: self.waiting_or_running)
    @rule(pick=PICKS)
    def abort(self, pick: int) -> None:
        request_id = self.waiting_or_running[pick % len(self.waiting_or_running)]
        self._run(f"abort({request_id!r})", lambda: self.adapter.abort(request_id))
        if request_id in self.waiting_or_running:
            self.waiting_or_running.remove(request_id)

    def _run(self, label: str, run: Callable[[], list[Call]]) -> None:
        raised = None
        try:
            calls = run()
        except ServerError as error:  # the server's own failure: a finding, then shrunk
            cause = error.__cause__
            calls, raised = error.calls, f"{type(cause).__name__}: {cause}"
        except Exception as error:  # raised outside the server's step: the adapter's fault
            with self.judge.tally.adapter_faults():
                raise AdapterError(
                    f"adapter {self.adapter.name!r}: {label} raised {one_line(error)} outside "
                    f"its server's step (not as a ServerError) at {self.step_text}"
                ) from error
        for call in calls:
            if call.operation == "release" and call.args[0] in self.waiting_or_running:
                self.waiting_or_running.remove(str(call.args[0]))
        self.judge.judge_step(label, calls, self.observed_after(label), raised)


def machine_for(
    factory: Callable[[], Adapter | EngineAdapter], tally: Tally | None = None
) -> type[ConformanceMachine]:
    """A conformance machine class for the adapters ``factory`` makes (an engine machine for
    an ``EngineAdapter``); run it with ``machine_for(factory).TestCase`` under pytest, or
    through ``harness.conformance.run``."""
    base: type[ConformanceMachine] = EngineMachine if is_engine(factory()) else OperationMachine
    return type(
        base.__name__,
        (base,),
        {"factory": staticmethod(factory), "tally": tally or Tally()},
    )


def _text(operation: str, args: tuple[object, ...]) -> str:
    return f"{operation}({', '.join(repr(arg) for arg in args)})"
