"""Each mode of the kit catches each planted bug, with a shrunk reproduction that names the
broken property and calls it a bug (not a declared difference)."""

from collections.abc import Callable

import pytest

from harness.conformance import Adapter, check_target
from harness.conformance.targets.pagedkv import PagedKVAdapter
from tests.conformance import planted_targets as planted
from tests.support import planted_bugs

Case = tuple[str, Callable[[], Adapter], str]

EXACT_CASES: list[Case] = [
    (
        "double free",
        lambda: PagedKVAdapter(manager_class=planted.FreesTheLastBlockTwice),
        "partition",
    ),
    ("off-by-one hit", planted.ReportsAHitOneBlockLong, "hit_maximal"),
    ("salt dropped", planted.DropsTheSalt, "hit_maximal"),
    (
        "leaked block",
        lambda: PagedKVAdapter(manager_class=planted_bugs.LeaksOneBlockOnRelease),
        "conservation",
    ),
    (
        "window frees one block early",
        lambda: PagedKVAdapter(
            group_windows=(None, 6), manager_class=planted_bugs.SkipsABlockOneStepEarly
        ),
        "window_untouched",
    ),
    (
        "ref count not dropped",
        lambda: PagedKVAdapter(manager_class=planted_bugs.SkipsSharedDecrement),
        "ref_counts",
    ),
]

REFINEMENT_CASES: list[Case] = [
    ("double free", planted.TransformersFreesTwice, "partition"),
    ("off-by-one hit", planted.TransformersHitsOneBlockShort, "hit_maximal"),
    ("leaked block", planted.TransformersLeaksABlock, "conservation"),
    ("ref count not dropped", planted.TransformersKeepsSharedReference, "ref_counts"),
]


def _assert_caught(factory: Callable[[], Adapter], prop: str) -> None:
    report = check_target(factory, steps=4000, seed_value=0)
    found = report.discrepancy
    assert found is not None, f"not caught: {report.describe()}"
    assert prop in {finding.name for finding in found.bugs()}, found.describe()
    assert len(found.steps) <= 8, f"not shrunk: {found.describe()}"
    text = report.describe()
    assert f"property {prop}: BUG" in text and "target:" in text and "spec:" in text


@pytest.mark.parametrize(("bug", "factory", "prop"), EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_exact_mode_catches_the_planted_bug(
    bug: str, factory: Callable[[], Adapter], prop: str
) -> None:
    _assert_caught(factory, prop)


@pytest.mark.parametrize(
    ("bug", "factory", "prop"), REFINEMENT_CASES, ids=[c[0] for c in REFINEMENT_CASES]
)
def test_refinement_mode_catches_the_planted_bug_in_transformers(
    bug: str, factory: Callable[[], Adapter], prop: str
) -> None:
    _assert_caught(factory, prop)


def test_refinement_mode_catches_a_window_freeing_one_block_early_in_vllm() -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (scripts/setup.sh installs it)")
    _assert_caught(planted.vllm_frees_one_block_early, "window_untouched")


def test_refinement_mode_catches_a_salt_that_never_reaches_vllm() -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (scripts/setup.sh installs it)")
    _assert_caught(planted.vllm_drops_the_salt, "hit_maximal")
