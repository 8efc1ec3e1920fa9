"""The bounded model checker on hybrid pools (``tests.support.bounded.HYBRID_SHAPES``),
and every planted state-group bug found by it along a shortest path."""

import pytest

from impl import KVCacheManager
from tests.support.bounded import Bounds, all_hybrid_bounds, check
from tests.support.state_planted_bugs import (
    STATE_PLANTED_BUGS,
    CheckpointKeyedInIntervals,
    CommonHitIsTheMax,
    FreesTheCheckpointBeforeItsCopy,
    HitsPastTheLastCheckpoint,
)

HYBRID = list(all_hybrid_bounds())
# The window of one beside a state group checkpointed every two tokens.
WINDOWED = HYBRID[0]

# Each state bug's shortest path from init in the windowed hybrid shape. Breadth first,
# so none shorter exists.
SHORTEST_FAILURES: dict[type[KVCacheManager], list[str]] = {
    # Checkpoint at 2 only: the prompt of 4 zeros and a one may hit 2, not 4.
    HitsPastTheLastCheckpoint: [
        "allocate('r0', (0,))",
        "append('r0', (0,))",
        "append('r0', (0,))",
        "cached_prefix_tokens((0, 0, 0, 0, 1), None)",
    ],
    # The checkpoint at 2 is keyed (0,), the prefix of one token.
    CheckpointKeyedInIntervals: [
        "allocate('r0', (0,))",
        "append('r0', (0,))",
        "append('r0', (0,))",
    ],
    # No checkpoint at all, and the window allows any hit: 4 tokens hit, no state.
    CommonHitIsTheMax: ["allocate('r0', (0, 0, 0, 0, 1))"],
    # The checkpoint at 2 goes to the free queue, its key evicted, as it is copied.
    FreesTheCheckpointBeforeItsCopy: [
        "allocate('r0', (0,))",
        "append('r0', (0,))",
        "append('r0', (0,))",
    ],
}


@pytest.mark.parametrize("bounds", HYBRID, ids=str)
def test_every_reachable_hybrid_state_of_the_small_pools_agrees_between_spec_and_impl(
    bounds: Bounds,
) -> None:
    report = check(bounds)
    assert report.violation is None, str(report.violation)
    assert report.states > 100


@pytest.mark.parametrize("broken", STATE_PLANTED_BUGS, ids=lambda cls: cls.__name__)
def test_the_hybrid_walk_finds_each_planted_state_bug_along_a_shortest_path(
    broken: type[KVCacheManager],
) -> None:
    violation = check(WINDOWED, broken).violation
    assert violation is not None, f"{broken.__name__} passed the bounded checker"
    assert [str(op) for op in violation.path] == SHORTEST_FAILURES[broken]


def test_every_planted_state_bug_has_a_listed_shortest_failure() -> None:
    assert set(SHORTEST_FAILURES) == set(STATE_PLANTED_BUGS)
