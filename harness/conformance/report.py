"""What a conformance run tells its user: the steps of a failing run, the target's and the
spec's side of each broken property, and whether it is a bug or a declared difference.

``DiscrepancyError`` is the exception the machine raises (Hypothesis shrinks the run that raised
it, so the steps it carries are the shortest found); ``Report`` is a whole run's summary.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from harness.conformance.adapter import Outcome
from harness.conformance.events import EVENT_RULES
from harness.conformance.properties import (
    ABSOLUTE_PROPERTIES,
    OBSERVATION_PROPERTIES,
    STATE_PROPERTIES,
    STEP_PROPERTIES,
    Expected,
    Finding,
)
from harness.conformance.view import Bijection


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call as run: what the target gave, what the spec gave on its state."""

    operation: str
    args: tuple[object, ...]
    outcome: Outcome
    expected: Expected | None

    def text(self) -> str:
        return f"{self.operation}({', '.join(repr(arg) for arg in self.args)})"

    def target_side(self) -> str:
        if self.outcome.refusal is not None:
            return "refused"
        result = self.outcome.result
        return "ok" if result is None else f"ok, {_result(result)}"

    def spec_side(self) -> str:
        expected = self.expected
        if expected is None:
            return "-"
        if expected.error is not None:
            return "not applicable"
        if expected.refusal is not None:
            return "refused"
        return "ok" if expected.hit is None else f"ok, hit {expected.hit} tokens"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of the machine: an operation (one call) or an engine step (its calls)."""

    label: str
    calls: tuple[CallRecord, ...]

    def lines(self, number: int) -> list[str]:
        if len(self.calls) == 1 and self.calls[0].text() == self.label:
            call = self.calls[0]
            return [f"{number:>3}. {self.label:<59} {call.target_side():<18} {call.spec_side()}"]
        lines = [f"{number:>3}. {self.label}"]
        for call in self.calls:
            lines.append(f"       {call.text():<57} {call.target_side():<18} {call.spec_side()}")
        return lines


class DiscrepancyError(AssertionError):
    """A property the target broke and did not declare as a difference."""

    def __init__(
        self,
        target: str,
        steps: Sequence[StepRecord],
        findings: Sequence[Finding],
        differences: Mapping[str, str],
        bijection: Bijection,
    ) -> None:
        self.target = target
        self.steps = list(steps)
        self.findings = list(findings)
        self.differences = dict(differences)
        self.bijection = bijection
        super().__init__(self.describe())

    def bugs(self) -> list[Finding]:
        return [f for f in self.findings if not declared_reason(f, self.differences)]

    def describe(self) -> str:
        names = ", ".join(sorted({f.name for f in self.bugs()}))
        lines = [f"DISCREPANCY in {self.target}: {names} after {len(self.steps)} step(s)"]
        lines.append(f"{'step':<64} {'target':<18} spec")
        for number, step in enumerate(self.steps, start=1):
            lines += step.lines(number)
        for finding in self.findings:
            reason = declared_reason(finding, self.differences)
            kind = f"declared policy difference ({reason})" if reason else "BUG"
            where = f" ({finding.operation})" if finding.operation else ""
            lines += [
                f"property {finding.name}: {kind}{where}",
                f"  rule:   {statement(finding.name)}",
                f"  target: {finding.target}",
                f"  spec:   {finding.spec}",
            ]
        renamed = {t: s for t, s in self.bijection.to_spec.items() if t != s}
        if renamed:
            pairs = ", ".join(f"{t}->{s}" for t, s in sorted(renamed.items()))
            lines.append(f"block ids above are the spec's; target -> spec: {pairs}")
        return "\n".join(lines)


def declared_reason(finding: Finding, differences: Mapping[str, str]) -> str | None:
    """Why the target differs on ``finding`` by design, if it declares it (a property, or
    ``property/operation`` for the operation of the call that broke it)."""
    return differences.get(finding.name) or differences.get(f"{finding.name}/{finding.operation}")


@dataclass(slots=True)
class Report:
    """A run's summary: what ran, which properties were checked, what was found."""

    target: str
    seed: int
    steps: int = 0
    cases: int = 0
    properties: list[str] = field(default_factory=list)
    declared: dict[str, int] = field(default_factory=dict)
    differences: dict[str, str] = field(default_factory=dict)
    discrepancy: DiscrepancyError | None = None

    def describe(self) -> str:
        verdict = "FAILED" if self.discrepancy else "all properties held"
        lines = [
            f"{self.target}: {self.steps} steps in {self.cases} test cases (seed {self.seed}): "
            f"{verdict}",
            f"  properties checked: {', '.join(self.properties)}",
        ]
        for name, count in sorted(self.declared.items()):
            reason = self.differences.get(name, "")
            lines.append(f"  declared difference {name}: seen {count} times ({reason})")
        if self.discrepancy is not None:
            lines.append(self.discrepancy.describe())
        return "\n".join(lines)


def checked_properties(exact: bool, engine: bool) -> list[str]:
    """The properties a run checks: all but ``exact_state`` outside exact mode, and the
    engine-step ones only for an engine adapter."""
    names = [*STATE_PROPERTIES, *OBSERVATION_PROPERTIES, *STEP_PROPERTIES, *ABSOLUTE_PROPERTIES]
    if not exact:
        names.remove("exact_state")
    if not engine:
        names = [n for n in names if n not in ("changes_accounted", "spec_accepts")]
    return names


def statement(name: str) -> str:
    """The rule of property ``name``, in one line."""
    text = STEP_PROPERTIES.get(name) or OBSERVATION_PROPERTIES.get(name)
    text = text or ABSOLUTE_PROPERTIES.get(name) or EVENT_RULES.get(name)
    if text:
        return text
    holds = STATE_PROPERTIES.get(name)
    doc = (holds.__doc__ or "").strip().splitlines() if holds else []
    return doc[0] if doc else name


def _result(result: object) -> str:
    return f"hit {result} tokens" if isinstance(result, int) else repr(result)
