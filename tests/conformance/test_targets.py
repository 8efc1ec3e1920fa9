"""Every bundled target holds every property it does not declare as a difference, over a
short seeded run (long runs: ``python -m harness.conformance``, docs/results.md)."""

import importlib.util

import pytest

from harness.conformance import assert_conforms
from harness.conformance.targets import CONFIGURATIONS, TARGETS

NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs the 'conformance' extra)",
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=NEEDS_VLLM) if name.startswith("vllm") else name
        for name in CONFIGURATIONS
    ],
)
def test_the_bundled_target_conforms(name: str) -> None:
    report = assert_conforms(CONFIGURATIONS[name], steps=1500, seed=7)
    assert report.steps >= 1500 and report.discrepancy is None


def test_exact_targets_are_checked_block_id_for_block_id_and_real_ones_are_not() -> None:
    exact = {name: CONFIGURATIONS[name]().exact for name in ("pagedkv-full", "article")}
    assert exact == {"pagedkv-full": True, "article": True}
    assert CONFIGURATIONS["transformers-full"]().exact is False


def test_every_target_name_lists_known_configurations() -> None:
    assert all(set(configs) <= set(CONFIGURATIONS) for configs in TARGETS.values())
    assert TARGETS["vllm"] == ("vllm-full", "vllm-hybrid")
    assert TARGETS["transformers"] == ("transformers-full", "transformers-sliding")
