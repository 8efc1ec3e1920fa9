"""The all-groups API, literal ids on spec and impl alike: one call gives a step every KV
cache group's table and the new tokens' slots, and a rollback says which slots it left
stale, so an engine asks once per request and computes no slot itself."""

import pytest

from impl import KVCacheManager
from impl.records import AppendedSlots
from impl.spec_backed import SpecBackedManager
from spec import ReleasedBlocks, RequestBlockTable
from tests.support.reading import free_ids, table

Manager = KVCacheManager | SpecBackedManager


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> type[Manager]:
    cls: type[Manager] = request.param
    return cls


def test_a_decode_append_gives_both_groups_tables_and_slots(make: type[Manager]) -> None:
    pool = make(8, 2, group_windows=(None, 2))
    pool.allocate("a", 3)  # group 0: [0, 1]; group 1: [2, 3]
    step = pool.append("a", 2)  # L0 = 3: the window drops block index 0 (block 2)
    assert step == AppendedSlots("a", 5, ((0, 1, 4), (3, 5)), (0, 1), ((3, 8), (7, 10)))
    assert pool.tables("a") == (step.table(0), step.table(1))


def test_the_first_chunk_slots_start_past_the_prefix_hit(make: type[Manager]) -> None:
    pool = make(8, 2)
    pool.allocate("a", [1, 2, 3, 4, 5])
    pool.release("a")  # blocks 1 and 0 stay cached
    assert pool.allocate("b", [1, 2, 3, 4, 9, 9]) == AppendedSlots(
        "b", 6, ((0, 1, 3),), (0,), ((6, 7),), cached_tokens=4
    )
    step = pool.append("b", [7])
    assert step.slots == ((8,),)


def test_a_rollback_reports_the_stale_slots_of_a_kept_last_block_it_holds_alone(
    make: type[Manager],
) -> None:
    pool = make(8, 4, group_windows=(None, 8))
    pool.allocate("a", 2)  # group 0: [0]; group 1: [1]
    pool.append("a", 5)  # 7 tokens: group 0 [0, 2], group 1 [1, 3]
    released = pool.truncate("a", 5)  # keeps 2 blocks; slots of tokens 5, 6 stale
    assert released == ReleasedBlocks((), (), (), ((9, 10), (13, 14)))


def test_a_rollback_into_a_block_a_fork_shares_reports_nothing_stale(
    make: type[Manager],
) -> None:
    pool = make(8, 4)
    pool.allocate("a", 7)  # [0, 1]
    pool.fork("a", "b")
    assert pool.truncate("a", 5) == ReleasedBlocks((), (), (), ((),))


def test_an_allocation_by_count_gives_the_slots_of_every_token(make: type[Manager]) -> None:
    pool = make(8, 4)
    pool.allocate("x", 1)  # block 0
    assert pool.allocate("a", 5) == AppendedSlots("a", 5, ((1, 2),), (0,), ((4, 5, 6, 7, 8),))


def test_the_wrong_kind_of_append_is_refused_in_words(make: type[Manager]) -> None:
    pool = make(8, 4)
    pool.allocate("a", 3)
    pool.allocate("p", [1])
    with pytest.raises(
        ValueError,
        match=r"^cannot append a count \(1\) to request 'p': it tracks token ids, so append",
    ):
        pool.append("p", 1)
    with pytest.raises(
        ValueError, match=r"^cannot append 2 token ids to request 'a': it was allocated by count"
    ):
        pool.append("a", [1, 2])


def test_decoding_token_by_token_fills_each_block_then_opens_the_next(
    make: type[Manager],
) -> None:
    pool = make(4, 4)
    pool.allocate("a", [1, 2])  # block 0
    slots = [pool.append("a", [token]).slots[0][0] for token in (3, 4, 5, 6, 7, 8, 9)]
    assert slots == [2, 3, 4, 5, 6, 7, 8]  # block 0, then 1, then 2
    assert pool.usage().allocated_tokens == 9
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 10]) == 8  # each filled block


def test_a_decode_token_into_a_shared_block_writes_a_copy_and_the_other_keeps_it(
    make: type[Manager],
) -> None:
    pool = make(4, 4)
    pool.allocate("a", [1, 2, 3])  # block 0, three tokens
    pool.fork("a", "b")
    assert pool.append("b", [4]).slots[0][0] == 7  # b copies block 0 into 1: row 4 + 3
    assert pool.to_spec().pending_copies == ((0, 1),)
    assert [pool.append("a", [token]).slots[0][0] for token in (5, 6)] == [3, 8]
    assert table(pool, "a") == RequestBlockTable("a", (0, 2), 5)
    assert table(pool, "b") == RequestBlockTable("b", (1,), 4)
    assert pool.usage().allocated_tokens == 9
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 0]) == 4  # b filled its copy: cached
    assert pool.cached_prefix_tokens([1, 2, 3, 5, 0]) == 4  # and a its own block 0


def test_a_decode_token_in_the_middle_of_a_shared_block_copies_it_first(
    make: type[Manager],
) -> None:
    pool = make(4, 4)
    pool.allocate("a", [1, 2])  # block 0, two tokens
    pool.fork("a", "b")
    assert pool.append("b", [3]).slots[0][0] == 6  # b copies block 0 into 1: row 4 + 2
    assert pool.to_spec().pending_copies == ((0, 1),)
    assert pool.append("a", [5]).slots[0][0] == 2  # a holds 0 alone now
    assert table(pool, "b") == RequestBlockTable("b", (1,), 3)


def test_a_block_a_salted_request_fills_while_decoding_is_cached_under_its_salt(
    make: type[Manager],
) -> None:
    pool = make(4, 4)
    pool.allocate("a", [1, 2, 3], "s")
    pool.append("a", [4])  # fills block 0
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 0], "s") == 4
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 0]) == 0


def test_a_decode_token_into_a_block_two_groups_share_copies_it_in_each(
    make: type[Manager],
) -> None:
    pool = make(8, 2, group_windows=(None, None))
    pool.allocate("a", 3)  # group 0: 0, 1 (token 3); group 1: 2, 3
    pool.fork("a", "b")
    appended = pool.append("b", 1)
    assert (appended.table(0), appended.table(1)) == (
        RequestBlockTable("b", (0, 4), 4),
        RequestBlockTable("b", (2, 5), 4),
    )
    assert appended.slots == ((9,), (11,))
    assert pool.to_spec().pending_copies == ((1, 4), (3, 5))
    assert pool.usage().allocated_tokens == 7


def test_two_groups_can_take_the_last_free_blocks(make: type[Manager]) -> None:
    pool = make(4, 2, group_windows=(None, None))
    pool.allocate("a", 2)  # blocks 0 and 1
    assert pool.append("a", 1).table() == RequestBlockTable("a", (0, 2), 3)
    assert (free_ids(pool), pool.usage().allocated_tokens) == ((), 3)


def test_a_name_that_is_no_operation_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match=r"^SpecBackedManager has no operation 'appendd'$"):
        SpecBackedManager(4, 2).appendd  # noqa: B018
