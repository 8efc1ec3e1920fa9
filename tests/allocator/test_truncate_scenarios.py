"""``truncate``, the rollback of rejected speculative tokens, with literal block ids, run on
the spec and on the impl alike."""

import pytest

from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import BlockRemoved, ReleasedBlocks, RequestBlockTable
from tests.support.reading import admitted, cached_free_ids, free_ids, table

Manager = KVCacheManager | SpecBackedManager
TEN = list(range(1, 11))  # a 10-token prompt: two full blocks of 4 and half a third


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> type[Manager]:
    factory: type[Manager] = request.param
    return factory


def test_drafts_appended_across_a_boundary_roll_back_last_block_first(make: type[Manager]) -> None:
    pool = make(6, 4)
    pool.allocate("a", 3)  # block 0
    assert pool.append("a", 6).table().block_ids == (0, 1, 2)  # 9 tokens: 6 drafts
    pool.truncate("a", 3)
    assert table(pool, "a") == RequestBlockTable("a", (0,), 3)
    assert free_ids(pool) == (3, 4, 5, 2, 1)
    assert pool.append("a", 1).slots[0][0] == 3  # the accepted token goes right after the kept ones
    assert pool.usage().allocated_tokens == 4


def test_a_cached_block_cut_in_the_middle_keeps_its_key_until_a_write(
    make: type[Manager],
) -> None:
    events: list[object] = []
    pool = make(8, 4, event_sink=events.append)
    pool.allocate("a", TEN)  # blocks 0 and 1 cached, block 2 half full
    released = pool.truncate("a", 6)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1), 6)
    assert free_ids(pool) == (3, 4, 5, 6, 7, 2)
    # Block 1 still holds 5..8's K/V: nothing is stale, and a second prompt reuses it.
    assert released.stale_slots == ((),)
    assert admitted(pool.allocate("b", TEN)) == (RequestBlockTable("b", (0, 1, 3), 10), 8)
    # Shared now, so a's next token goes into a copy and b keeps block 1 cached.
    pool.append("a", [0])
    assert table(pool, "a") == RequestBlockTable("a", (0, 4), 7)
    assert pool.take_transfers().copies == ((1, 4),)
    assert pool.cached_prefix_tokens(TEN) == 8
    assert not [event for event in events if isinstance(event, BlockRemoved)]


def test_a_write_into_a_block_a_rollback_left_cached_forgets_its_key_first(
    make: type[Manager],
) -> None:
    events: list[object] = []
    pool = make(8, 4, event_sink=events.append)
    pool.allocate("a", TEN)  # blocks 0 and 1 cached, block 2 half full
    pool.truncate("a", 6)
    assert pool.cached_prefix_tokens(TEN) == 8
    events.clear()
    pool.append("a", [0])  # a holds block 1 alone: written in place, its key ends first
    assert table(pool, "a") == RequestBlockTable("a", (0, 1), 7)
    assert events == [BlockRemoved(1, 0)]
    assert pool.cached_prefix_tokens(TEN) == 4


def test_a_rollback_into_a_block_shared_across_a_hit_costs_the_other_holder_no_hit(
    make: type[Manager],
) -> None:
    # Found by the metamorphic relation "a cache salt never raises hits": unsalted, b hits
    # a's blocks and a rolls back into them; salted apart, b kept its own. The shared
    # block stays cached, for b and for the next prompt.
    pool = make(5, 2)
    pool.allocate("a", [1, 2, 1, 2, 0, 0, 1])  # blocks 0 (1, 2), 1 (1, 2, 1, 2) cached
    pool.truncate("a", 4)
    pool.allocate("b", [1, 2, 1, 2, 1, 2])  # hits blocks 0 and 1
    pool.release("b")
    pool.truncate("a", 3)  # into block 1, held by a alone now: its key stays
    # Blocks 0, 1 and the cut block 2 (1, 2, 1, 2, 0, 0), cached free: the chain is whole.
    assert pool.cached_prefix_tokens([1, 2, 1, 2, 0, 0, 1]) == 6


def test_cut_blocks_that_hold_a_cached_prefix_wait_in_the_cached_free_queue(
    make: type[Manager],
) -> None:
    pool = make(8, 4)
    pool.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0, 1 cached; block 2
    pool.truncate("a", 4)
    assert table(pool, "a") == RequestBlockTable("a", (0,), 4)
    assert free_ids(pool) == (3, 4, 5, 6, 7, 2)
    assert cached_free_ids(pool) == (1,)
    hit = pool.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert admitted(hit) == (RequestBlockTable("b", (0, 1, 3), 9), 8)


def test_a_shared_block_left_partly_filled_is_copied_by_the_next_append(
    make: type[Manager],
) -> None:
    pool = make(6, 4)
    pool.allocate("p", 8)  # blocks 0 and 1, both full
    pool.fork("p", "c")
    pool.truncate("c", 6)
    assert table(pool, "c") == RequestBlockTable("c", (0, 1), 6)
    assert pool.append("c", 1).table() == RequestBlockTable("c", (0, 2), 7)
    assert pool.take_transfers().copies == ((1, 2),)
    assert table(pool, "p") == RequestBlockTable("p", (0, 1), 8)


def test_a_tracked_request_forgets_the_cut_tokens(make: type[Manager]) -> None:
    pool = make(4, 4)
    pool.allocate("a", [1, 2, 3])
    pool.append("a", [4, 5, 6])  # block 0 full and cached, block 1 holds 5, 6
    pool.truncate("a", 4)
    assert table(pool, "a") == RequestBlockTable("a", (0,), 4)
    assert free_ids(pool) == (2, 3, 1)
    assert pool.append("a", [9]).table() == RequestBlockTable("a", (0, 2), 5)
    # The cut tokens 5, 6 are forgotten: the block the next four fill holds 9s, and a
    # prompt continuing with 5, 6, 7, 8 finds only block 0.
    pool.append("a", [9, 9, 9])
    hit = pool.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert hit.cached_tokens == 4


@pytest.mark.parametrize(
    ("request_id", "token_count", "error", "message"),
    [
        ("a", 6, ValueError, "cannot truncate request 'a' to 6 tokens: it holds 5"),
        ("a", -1, ValueError, "token_count must be non-negative, got -1"),
        ("a", 2.0, TypeError, "token_count must be an int, got float 2.0"),
        ("x", 1, KeyError, "request has no allocated blocks: x"),
    ],
)
def test_a_refused_truncate_changes_nothing(
    make: type[Manager], request_id: str, token_count: int, error: type[Exception], message: str
) -> None:
    pool = make(4, 4)
    pool.allocate("a", 5)
    before = (free_ids(pool), table(pool, "a"), pool.usage())
    with pytest.raises(error) as refused:
        pool.truncate(request_id, token_count)
    assert message in str(refused.value)
    assert (free_ids(pool), table(pool, "a"), pool.usage()) == before


def test_a_rollback_in_two_groups_reports_both_groups_blocks_and_stale_slots(
    make: type[Manager],
) -> None:
    pool = make(8, 2, group_windows=(None, None))
    pool.allocate("p", [1, 2, 3, 4, 5])  # group 0: 0, 1, 2; group 1: 3, 4, 5
    released = pool.truncate("p", 1)
    # Per group, last first: 2 free, 1 cached free (1..4); 5 free, 4 cached free. Blocks 0
    # and 3 are cut into but keep their keys (1, 2): no slot of them is stale.
    assert released == ReleasedBlocks((1, 2, 4, 5), (2, 5), (1, 4), ((), ()))
    assert (free_ids(pool), cached_free_ids(pool)) == ((6, 7, 2, 5), (1, 4))
