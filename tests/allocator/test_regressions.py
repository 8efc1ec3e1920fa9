"""Every failure a checker has found, kept as an explicit scenario.

Saved Hypothesis examples do not survive a Hypothesis upgrade, and a bounded walk is only
as good as its bounds; these paths are literal and stay. Each runs from ``init`` on the
spec and the impl with every check of the bounded checker, and must still fail on the
broken allocator it was found in.
"""

from dataclasses import dataclass

import pytest

from impl import KVCacheManager
from tests.support.bounded import Bounds, Operation, check_path
from tests.support.planted_bugs import (
    DecodeSlotFromStaleBlock,
    LeaksOneBlockOnRelease,
    OffByOneAtBlockBoundary,
    RefusedAllocateTakesBlocks,
    ReleasesInTableOrder,
)

IDS = ("r0", "r1", "r2")


@dataclass(frozen=True)
class Regression:
    """A path from ``init`` on a ``total_blocks`` x ``block_size`` pool, and its origin."""

    name: str
    total_blocks: int
    block_size: int
    path: tuple[Operation, ...]
    found_in: type[KVCacheManager]
    reason_starts: str

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.total_blocks, self.block_size, IDS, self.total_blocks * self.block_size)


def alloc(request_id: str, token_count: int) -> Operation:
    return Operation("allocate", (request_id, token_count))


def slot(request_id: str) -> Operation:
    return Operation("append", (request_id, 1))


def release(request_id: str) -> Operation:
    return Operation("release", (request_id,))


REGRESSIONS = [
    # Found by the bounded checker (shortest paths) and the state machine.
    Regression(
        "a released request's blocks go back last block first",
        2, 1, (alloc("r0", 2), release("r0")),
        ReleasesInTableOrder, "spec returned ReleasedBlocks(",
    ),
    Regression(
        "a release returns every block, the last one included",
        1, 1, (alloc("r0", 1), release("r0")),
        LeaksOneBlockOnRelease, "impl state",
    ),
    Regression(
        "an allocation refused for want of blocks takes none",
        1, 1, (alloc("r0", 2),),
        RefusedAllocateTakesBlocks, "refused allocate('r0', 2) was not atomic",
    ),
    Regression(
        "an empty request holds no block",
        1, 1, (alloc("r0", 0),),
        OffByOneAtBlockBoundary, "spec returned",
    ),
    Regression(
        "a request ending exactly on a boundary holds no spare block",
        2, 2, (alloc("r0", 2),),
        OffByOneAtBlockBoundary, "spec returned",
    ),
    Regression(
        "a decode step that opens a block writes into the new block",
        2, 1, (alloc("r0", 1), slot("r0")),
        DecodeSlotFromStaleBlock, "spec returned AppendedSlots(",
    ),
    Regression(
        "a decode step that opens a reused block writes into that block",
        2, 2, (alloc("r0", 2), alloc("r1", 1), slot("r1"), release("r0"), slot("r1")),
        DecodeSlotFromStaleBlock, "spec returned AppendedSlots(",
    ),
    Regression(
        "releasing one of two requests frees only its blocks, last block first",
        3, 1, (alloc("r0", 1), alloc("r1", 2), release("r1")),
        ReleasesInTableOrder, "spec returned ReleasedBlocks(",
    ),
]  # fmt: skip


@pytest.mark.parametrize("regression", REGRESSIONS, ids=lambda r: r.name)
def test_the_regression_passes_on_the_impl(regression: Regression) -> None:
    assert check_path(regression.bounds, regression.path) is None


@pytest.mark.parametrize("regression", REGRESSIONS, ids=lambda r: r.name)
def test_the_regression_still_fails_on_the_allocator_it_was_found_in(
    regression: Regression,
) -> None:
    violation = check_path(regression.bounds, regression.path, regression.found_in)
    assert violation is not None
    assert violation.path == regression.path, "it failed before its last step"
    assert violation.reason.startswith(regression.reason_starts), violation.reason
