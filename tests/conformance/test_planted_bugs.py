"""Each property of the kit catches a bug planted in pagedkv's own allocator, in exact or
refinement mode, with a shrunk reproduction that names the broken property and calls it a
bug (not a declared difference). Bugs planted in vLLM's and transformers' own code: the
zoo (test_zoo.py)."""

from collections.abc import Callable

import pytest

from harness.conformance import Adapter, check_target
from harness.conformance.targets.pagedkv import PagedKVAdapter
from tests.conformance import planted_targets as planted
from tests.support import planted_bugs

Case = tuple[str, Callable[[], Adapter], str]

CASES: list[Case] = [
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
    ("computed blocks never cached", planted.ForgetsWhatItComputed, "computed_findable"),
    ("cache emptied without need", planted.EmptiesTheCacheOnRelease, "eviction_justified"),
    ("lost hits, cache not shown", planted.HidesItsCacheAndMissesHits, "shadow_hit_maximal"),
]


@pytest.mark.parametrize(("bug", "factory", "prop"), CASES, ids=[c[0] for c in CASES])
def test_the_kit_catches_the_planted_bug(
    bug: str, factory: Callable[[], Adapter], prop: str
) -> None:
    report = check_target(factory, steps=4000, seed=0)
    found = report.discrepancy
    assert found is not None, f"not caught: {report.describe()}"
    assert prop in {finding.name for finding in found.bugs()}, found.describe()
    assert len(found.steps) <= 8, f"not shrunk: {found.describe()}"
    text = report.describe()
    assert f"property {prop}: BUG" in text and "target:" in text and "spec:" in text
