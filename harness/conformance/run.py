"""Running the conformance machine for a number of steps from a seed, and the pytest entry.

``check_target`` runs batches of Hypothesis test cases (seeded ``seed``, ``seed + 1``, ...)
until ``steps`` steps have run or a discrepancy is found, which Hypothesis first shrinks;
it returns a ``Report``. ``assert_conforms`` is the same for a user's own test suite: it
raises ``AssertionError`` with the report when a property breaks.
"""

import time
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import get_state_machine_test

from harness.conformance.adapter import Adapter
from harness.conformance.machine import Tally, machine_for
from harness.conformance.report import DiscrepancyError, Report, checked_properties

# Steps a test case runs at most; Hypothesis draws fewer now and then.
STEPS_PER_CASE = 50
CASES_PER_BATCH = 50


def check_target(
    factory: Callable[[], Adapter],
    *,
    steps: int,
    seed_value: int,
    progress: Callable[[Report], None] | None = None,
    progress_every_s: float = 10.0,
) -> Report:
    """Run ``factory``'s adapters for at least ``steps`` steps, or to the first discrepancy."""
    probe = factory()
    properties = checked_properties(probe.exact)
    if probe.observe().ref_counts is None:
        properties.remove("ref_counts")
    report = Report(
        target=probe.name,
        seed=seed_value,
        properties=properties,
        differences=dict(probe.differences),
    )
    tally = Tally()
    last = [time.monotonic()]

    def on_case() -> None:
        report.steps, report.cases = tally.steps, tally.cases
        if progress is not None and time.monotonic() - last[0] >= progress_every_s:
            last[0] = time.monotonic()
            progress(report)

    tally.on_case = on_case
    machine = machine_for(factory, tally)
    batch = 0
    while tally.steps < steps:
        test = get_state_machine_test(
            machine,
            settings=settings(
                # Smaller batches near the end, so a run overshoots ``steps`` by little.
                max_examples=max(1, min(CASES_PER_BATCH, (steps - tally.steps) // 8 + 1)),
                stateful_step_count=STEPS_PER_CASE,
                deadline=None,
                database=None,
                derandomize=False,
                print_blob=False,
                report_multiple_bugs=False,
                phases=[Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck),
            ),
        )
        try:
            seed(seed_value * 1_000_003 + batch)(test)()
        except DiscrepancyError as found:
            report.discrepancy = found
            break
        batch += 1
    report.steps, report.cases = tally.steps, tally.cases
    report.declared = dict(tally.declared)
    return report


def assert_conforms(factory: Callable[[], Adapter], *, steps: int = 2000, seed: int = 0) -> Report:
    """Check the adapters ``factory`` makes for ``steps`` steps; raise ``AssertionError``
    with the report (shrunk steps, both sides) on a discrepancy, else return the report."""
    report = check_target(factory, steps=steps, seed_value=seed)
    if report.discrepancy is not None:
        raise AssertionError(report.describe())
    return report
