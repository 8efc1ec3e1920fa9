"""Running the conformance machine for a number of steps from a seed, and the pytest entry.

``check_target`` runs batches of Hypothesis test cases (each batch seeded from ``seed``)
until ``steps`` steps have run or a discrepancy is found, which Hypothesis first shrinks;
it returns a ``Report``. ``assert_conforms`` is the same for a user's own test suite: it
raises ``AssertionError`` with the report when a property breaks. Both take the same
keywords: ``steps`` and ``seed``. Both refuse their arguments and a broken adapter before
the first step (``harness.conformance.validate``), and raise ``AdapterError`` when the
adapter's own view of its target fails during the run.
"""

import contextlib
import time
from collections.abc import Callable, Iterator

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.internal.conjecture import engine as conjecture_engine
from hypothesis.stateful import get_state_machine_test

from harness.conformance.adapter import Adapter, EngineAdapter, is_engine
from harness.conformance.judge import Tally
from harness.conformance.machine import machine_for
from harness.conformance.report import DiscrepancyError, Report, checked_properties
from harness.conformance.validate import check_run_arguments, observed, validated_adapter


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``check_target``: ``report`` holds what ran until then."""

    def __init__(self, report: Report) -> None:
        super().__init__()
        self.report = report


# Steps a test case runs at most; Hypothesis draws fewer now and then.
STEPS_PER_CASE = 50
CASES_PER_BATCH = 50


def check_target(
    factory: Callable[[], Adapter | EngineAdapter],
    *,
    steps: int = 2000,
    seed: int = 0,
    progress: Callable[[Report], None] | None = None,
    progress_every_s: float = 10.0,
    shrink_seconds: float = 120.0,
) -> Report:
    """Run the adapters ``factory`` makes (a fresh one per test case) for at least ``steps``
    steps, or to the first discrepancy, shrunk for at most ``shrink_seconds``;
    ``progress(report)`` is called once the adapter is accepted, before the first step, then
    every ``progress_every_s`` seconds, after a step or a test case. Never raises for a
    discrepancy: the report carries it. A bad argument is a ``TypeError`` or ``ValueError``
    naming it, a broken factory or adapter an ``AdapterError``, before any step; a fault of
    the adapter's own view during the run an ``AdapterError`` too."""
    check_run_arguments(
        steps=steps, seed=seed, shrink_seconds=shrink_seconds, progress_every_s=progress_every_s
    )
    probe = validated_adapter(factory)
    properties = checked_properties(bool(getattr(probe, "exact", False)), is_engine(probe))
    if observed(probe, "on a fresh adapter").ref_counts is None:
        properties.remove("ref_counts")
    report = Report(
        target=probe.name,
        seed=seed,
        properties=properties,
        differences=dict(probe.differences),
    )
    tally = Tally()
    last = [time.monotonic()]

    def on_progress() -> None:
        report.steps, report.cases = tally.steps, tally.cases
        if progress is not None and time.monotonic() - last[0] >= progress_every_s:
            last[0] = time.monotonic()
            progress(report)

    tally.on_progress = on_progress
    if progress is not None:
        progress(report)
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
            with _shrinking_for(shrink_seconds):
                hypothesis_seed(seed * 1_000_003 + batch)(test)()
        except DiscrepancyError as found:
            report.discrepancy = found
            break
        except KeyboardInterrupt:
            report.steps, report.cases = tally.steps, tally.cases
            raise RunInterrupted(report) from None
        except Exception:
            # The adapter's fault, as Hypothesis raised it once shrunk, or its Flaky* error
            # when the fault did not recur on a replay (judge.Tally.adapter_faults).
            if tally.fault is None:
                raise
            raise tally.fault  # noqa: B904 (its cause is the adapter's own exception)
        batch += 1
    report.steps, report.cases = tally.steps, tally.cases
    report.declared = dict(tally.declared)
    return report


def assert_conforms(
    factory: Callable[[], Adapter | EngineAdapter], *, steps: int = 2000, seed: int = 0
) -> Report:
    """Check the adapters ``factory`` makes for ``steps`` steps; raise ``AssertionError``
    with the report (shrunk steps, both sides) on a discrepancy, else return the report.
    Refuses what ``check_target`` refuses, with the same errors."""
    report = check_target(factory, steps=steps, seed=seed)
    if report.discrepancy is not None:
        raise AssertionError(report.describe())
    return report


@contextlib.contextmanager
def _shrinking_for(seconds: float) -> Iterator[None]:
    """Hypothesis shrinks for up to 300 s (``MAX_SHRINKING_SECONDS``, not a setting); an
    engine target replays a whole server per attempt, so the kit bounds it itself."""
    default = conjecture_engine.MAX_SHRINKING_SECONDS
    conjecture_engine.MAX_SHRINKING_SECONDS = int(seconds)
    try:
        yield
    finally:
        conjecture_engine.MAX_SHRINKING_SECONDS = default
