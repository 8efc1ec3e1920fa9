"""``append_or_preempt``: the one preempt-and-retry loop, on a pool of counted free blocks."""

from harness.runtime.preemption import append_or_preempt
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
