"""``append_or_preempt``: the one preempt-and-retry loop, on a pool of counted free blocks;
and ``Scheduler.grow``, the engine's loop, picking the same victims on a real manager."""

import pytest

from harness.runtime.preemption import append_or_preempt
from harness.runtime.requests import Request, RunningRequest, new_running
from harness.runtime.scheduler import NO_SCHEDULING, Scheduler
from impl import AppendedSlots, KVCacheManager
from spec import BlockAllocationError


class CountedPool:
    """``free`` blocks; each append takes one, each preemption gives ``held`` back."""

    def __init__(self, free: int, held: int = 1) -> None:
        self.free = free
        self.held = held
        self.appended: list[str] = []
        self.preempted: list[str] = []

    def append(self, request_id: str) -> None:
        if self.free == 0:
            raise BlockAllocationError(f"no free block for {request_id}")
        self.free -= 1
        self.appended.append(request_id)

    def preempt(self, request_id: str) -> None:
        self.free += self.held
        self.preempted.append(request_id)


def test_a_dry_pool_preempts_the_most_recently_admitted_and_retries_the_same_request() -> None:
    pool = CountedPool(free=2)
    running = ["a", "b", "c", "d"]
    append_or_preempt(running, pool.append, pool.preempt)
    assert pool.appended == ["a", "b", "c"]
    assert pool.preempted == ["d"]
    assert running == ["a", "b", "c"]


def test_victims_go_last_admitted_first_until_the_request_fits() -> None:
    pool = CountedPool(free=0)
    running = ["a", "b", "c"]
    append_or_preempt(running, pool.append, pool.preempt)
    # c's block lets a append; b finds the pool dry again and is the last admitted left.
    assert pool.preempted == ["c", "b"]
    assert pool.appended == ["a"]
    assert running == ["a"]


def test_a_request_that_fails_alone_preempts_itself_and_ends_the_loop() -> None:
    pool = CountedPool(free=0, held=0)
    running = ["a", "b"]
    append_or_preempt(running, pool.append, pool.preempt)
    assert pool.preempted == ["b", "a"]
    assert running == []
    assert pool.appended == []


def test_a_pool_with_room_appends_everyone_in_admission_order() -> None:
    pool = CountedPool(free=3)
    running = ["a", "b", "c"]
    append_or_preempt(running, pool.append, pool.preempt)
    assert pool.appended == ["a", "b", "c"]
    assert pool.preempted == []


# -- Scheduler.grow: the same rule, the victims handed back -------------------------------


def grow_all(
    free: int, running_ids: list[str], scheduled_ids: list[str]
) -> tuple[list[str], list[str], list[str]]:
    """Each of ``running_ids`` holds one full block of 4 tokens, ``free`` blocks more; each
    of ``scheduled_ids`` appends a token (a new block). ``Scheduler.grow`` until done, each
    victim preempted: the grown, the victims, the running left."""
    manager = KVCacheManager(len(running_ids) + free, 4)
    scheduler = Scheduler(manager, NO_SCHEDULING, prefix_caching=False)
    running: list[RunningRequest] = []
    for request_id in running_ids:
        current = new_running(Request(request_id, (1, 2, 3, 4), 4))
        manager.allocate(request_id, 4)
        current.pending_ids = [5]
        running.append(current)
    scheduled = [r for r in running if r.request.request_id in scheduled_ids]
    grown: dict[str, AppendedSlots] = {}
    victims = []
    while (victim := scheduler.grow(running, scheduled, grown)) is not None:
        manager.preempt(victim.request.request_id)
        victims.append(victim.request.request_id)
    return list(grown), victims, [r.request.request_id for r in running]


@pytest.mark.parametrize(
    ("free", "running", "scheduled"),
    [
        (2, ["a", "b", "c", "d"], ["a", "b", "c", "d"]),
        (0, ["a", "b", "c"], ["a", "b", "c"]),
        (2, ["a", "b", "c", "d"], ["a", "c", "d"]),  # b feeds nothing this step
        (0, ["a", "b"], ["a"]),  # the victim feeds nothing this step
    ],
)
def test_the_engines_loop_preempts_as_append_or_preempt_does(
    free: int, running: list[str], scheduled: list[str]
) -> None:
    grown, victims, left = grow_all(free, running, scheduled)
    pool = CountedPool(free=free)

    def append(request_id: str) -> None:
        if request_id in scheduled:
            pool.append(request_id)

    expected = list(running)
    append_or_preempt(expected, append, pool.preempt)
    assert (grown, victims, left) == (pool.appended, pool.preempted, expected)
