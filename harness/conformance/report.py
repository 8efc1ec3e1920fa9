"""What a conformance run tells its user: the steps of a failing run, the target's and the
spec's side of each broken property, and whether it is a bug or a declared difference.

``DiscrepancyError`` is the exception the machine raises (Hypothesis shrinks the run that raised
it, so the steps it carries are the shortest found); ``Report`` is a whole run's summary.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from harness.conformance.properties import (
    OBSERVATION_PROPERTIES,
    STATE_PROPERTIES,
    STEP_PROPERTIES,
    Expected,
    Finding,
    Outcome,
)
from harness.conformance.view import Bijection


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as run: the call, what the target gave, what the spec gave on its state."""

    operation: str
    args: tuple[object, ...]
    outcome: Outcome
    expected: Expected

    def call(self) -> str:
        return f"{self.operation}({', '.join(repr(arg) for arg in self.args)})"

    def target_side(self) -> str:
        if self.outcome.refusal is not None:
            return "refused"
        return "ok" if self.outcome.result is None else f"ok, {_result(self.outcome.result)}"

    def spec_side(self) -> str:
        if self.expected.error is not None:
            return "not applicable"
        if self.expected.refusal is not None:
            return "refused"
        result = self.expected.result
        cached = getattr(result, "cached_tokens", None)
        return "ok" if cached is None else f"ok, hit {cached} tokens"


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
        return [f for f in self.findings if not self._declared(f)]

    def _declared(self, finding: Finding) -> str | None:
        operation = self.steps[-1].operation if self.steps else ""
        return self.differences.get(finding.name) or self.differences.get(
            f"{finding.name}/{operation}"
        )

    def describe(self) -> str:
        names = ", ".join(sorted({f.name for f in self.bugs()}))
        lines = [f"DISCREPANCY in {self.target}: {names} after {len(self.steps)} step(s)"]
        lines.append(f"{'step':<64} {'target':<18} spec")
        for number, step in enumerate(self.steps, start=1):
            lines.append(
                f"{number:>3}. {step.call():<59} {step.target_side():<18} {step.spec_side()}"
            )
        for finding in self.findings:
            reason = self._declared(finding)
            kind = f"declared policy difference ({reason})" if reason else "BUG"
            statement = (
                STEP_PROPERTIES.get(finding.name)
                or OBSERVATION_PROPERTIES.get(finding.name)
                or _state_statement(finding.name)
            )
            lines += [
                f"property {finding.name}: {kind}",
                f"  rule:   {statement}",
                f"  target: {finding.target}",
                f"  spec:   {finding.spec}",
            ]
        renamed = {t: s for t, s in self.bijection.to_spec.items() if t != s}
        if renamed:
            pairs = ", ".join(f"{t}->{s}" for t, s in sorted(renamed.items()))
            lines.append(f"block ids above are the spec's; target -> spec: {pairs}")
        return "\n".join(lines)


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
            reason = self.differences.get(name) or next(
                (r for k, r in self.differences.items() if k.startswith(f"{name}/")), ""
            )
            lines.append(f"  declared difference {name}: seen {count} times ({reason})")
        if self.discrepancy is not None:
            lines.append(self.discrepancy.describe())
        return "\n".join(lines)


def checked_properties(exact: bool) -> list[str]:
    names = [*STATE_PROPERTIES, *OBSERVATION_PROPERTIES, *STEP_PROPERTIES]
    return names if exact else [n for n in names if n != "exact_state"]


def _state_statement(name: str) -> str:
    holds = STATE_PROPERTIES.get(name)
    doc = (holds.__doc__ or "").strip().splitlines() if holds else []
    return doc[0] if doc else name


def _result(result: object) -> str:
    return f"hit {result} tokens" if isinstance(result, int) else repr(result)
