"""The zoo's score: each real bug class planted in vLLM's or transformers' own code
(``tests.conformance.zoo``) changes what the library does, and the kit catches it, by the
property named, with a shrunk run. README.md reports the score (caught of planted)."""

import importlib.util

import pytest

from harness.conformance import check_target
from harness.conformance.targets import configuration
from tests.conformance.zoo import ZOO, Mutant

# Seeded and small: each mutant is caught within this many steps (most in a few hundred),
# its run shrunk for at most SHRINK_SECONDS to at most SHRUNK_STEPS steps.
STEPS = 1500
SHRINK_SECONDS = 30
SHRUNK_STEPS = 40  # arrivals included; a test case runs up to 50


def _needs(mutant: Mutant) -> list[pytest.MarkDecorator]:
    missing = mutant.configuration.startswith("vllm") and importlib.util.find_spec("vllm") is None
    return [pytest.mark.skip(reason="vllm is not installed (scripts/setup.sh)")] if missing else []


CASES = [pytest.param(m, id=f"{m.configuration}:{m.function}", marks=_needs(m)) for m in ZOO]


def test_the_zoo_has_at_least_twelve_real_bug_classes_across_two_targets() -> None:
    assert len(ZOO) >= 12
    assert {m.configuration.split("-")[0] for m in ZOO} == {"vllm", "transformers"}


@pytest.mark.parametrize("mutant", CASES)
def test_the_planted_bug_changes_what_the_library_does(
    mutant: Mutant, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = mutant.shows()
    mutant.plant(monkeypatch)
    assert mutant.shows() != clean, f"{mutant.function}: the mutant changes nothing"


@pytest.mark.parametrize("mutant", CASES)
def test_the_kit_catches_the_planted_bug(mutant: Mutant, monkeypatch: pytest.MonkeyPatch) -> None:
    mutant.plant(monkeypatch)
    factory = configuration(mutant.configuration, known_findings=True)
    report = check_target(factory, steps=STEPS, shrink_seconds=SHRINK_SECONDS)
    found = report.discrepancy
    assert found is not None, f"not caught: {mutant.name} ({mutant.tracker})"
    assert mutant.caught_by in {f.name for f in found.bugs()}, found.describe()
    assert len(found.steps) <= SHRUNK_STEPS, f"not shrunk: {found.describe()}"
