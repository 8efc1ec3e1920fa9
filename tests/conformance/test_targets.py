"""Every bundled target holds every property it does not declare as a difference, over a
short seeded run, with its findings (docs/findings/) declared; without them the kit
reports the findings (test_findings.py). Long runs: ``python -m harness.conformance``,
docs/results.md."""

import importlib.util

import pytest

from harness.conformance import assert_conforms
from harness.conformance.adapter import is_engine
from harness.conformance.targets import CONFIGURATIONS, TARGETS, configuration

NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs the 'conformance' pins)",
)
# An engine step runs a whole scheduler step (several allocator calls, each judged).
STEPS = {"operation": 1500, "engine": 300}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=NEEDS_VLLM) if name.startswith("vllm") else name
        for name in CONFIGURATIONS
    ],
)
def test_the_bundled_target_conforms_but_for_its_findings(name: str) -> None:
    factory = configuration(name, known_findings=True)
    steps = STEPS["engine" if is_engine(factory()) else "operation"]
    report = assert_conforms(factory, steps=steps, seed=7)
    assert report.steps >= steps and report.discrepancy is None


def test_exact_targets_are_checked_block_id_for_block_id_and_servers_are_not() -> None:
    exact = {name: getattr(CONFIGURATIONS[name](), "exact", False) for name in CONFIGURATIONS}
    assert {name for name, is_exact in exact.items() if is_exact} == {
        "pagedkv-full",
        "pagedkv-windowed",
        "article",
    }


def test_the_servers_are_driven_by_engine_steps_and_the_allocators_by_operations() -> None:
    engines = {name for name in ("pagedkv-full", "article", "transformers-full")}
    assert {name for name in engines if is_engine(CONFIGURATIONS[name]())} == {"transformers-full"}


def test_every_target_name_lists_known_configurations() -> None:
    assert all(set(configs) <= set(CONFIGURATIONS) for configs in TARGETS.values())
    assert TARGETS["vllm"] == ("vllm-full", "vllm-hybrid")
    assert TARGETS["transformers"] == ("transformers-full", "transformers-sliding")
