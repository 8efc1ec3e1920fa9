"""Scenarios with literal block ids, run on the spec and on the impl alike (requests
allocated by count); then the article layer's own calls."""

from collections.abc import Callable

import pytest

from impl import BlockAllocationError, KVBlockManager, KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import RequestBlockTable
from tests.support.reading import free_ids, table

Factory = Callable[[int, int], KVCacheManager]


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    factory: Factory = request.param
    return factory


def test_the_articles_example_gives_its_block_ids_and_usage(make: Factory) -> None:
    pool = make(64, 16)
    tables = [pool.allocate(f"r{i}", n) for i, n in enumerate([9, 17, 33, 5, 41, 12])]
    assert [t.table().block_ids for t in tables] == [
        (0,),
        (1, 2),
        (3, 4, 5),
        (6,),
        (7, 8, 9),
        (10,),
    ]
    usage = pool.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.request_count) == (11, 53, 6)
    assert (usage.allocated_tokens, usage.reserved_tokens) == (117, 176)
    assert usage.internal_fragmentation_tokens == 59
    assert usage.block_utilization == 117 / 176
    assert free_ids(pool)[:3] == (11, 12, 13)


def test_release_returns_table_order_and_frees_last_block_first(make: Factory) -> None:
    pool = make(6, 4)
    pool.allocate("a", 9)  # blocks 0, 1, 2
    pool.allocate("b", 4)  # block 3
    assert pool.release("a").block_ids == (0, 1, 2)
    free_after_release = free_ids(pool)
    assert free_after_release == (4, 5, 2, 1, 0)
    # The next allocation takes from the head: the never-used blocks, then a's last block.
    assert pool.allocate("c", 12).table().block_ids == (4, 5, 2)
    assert free_ids(pool) == (1, 0)


def test_append_fills_the_last_block_before_taking_a_new_one(make: Factory) -> None:
    pool = make(4, 4)
    pool.allocate("a", 3)
    assert pool.append("a", 1).table().block_ids == (0,)  # 4 tokens: exactly one full block
    assert pool.append("a", 1).table().block_ids == (0, 1)  # the 5th token opens block 1
    assert pool.append("a", 4).table() == RequestBlockTable("a", (0, 1, 2), 9)
    assert pool.append("a", 0).table() == RequestBlockTable("a", (0, 1, 2), 9)


def test_zero_token_request_holds_no_block_until_its_first_token(make: Factory) -> None:
    pool = make(2, 8)
    assert pool.allocate("a", 0).table() == RequestBlockTable("a", (), 0)
    assert pool.usage().request_count == 1 and pool.usage().used_blocks == 0
    assert pool.append("a", 1).table().block_ids == (0,)
    assert pool.release("a").block_ids == (0,)


def test_exhaustion_is_refused_with_the_numbers_and_changes_nothing(make: Factory) -> None:
    pool = make(3, 4)
    pool.allocate("a", 8)
    before = (free_ids(pool), table(pool, "a"), pool.usage())
    with pytest.raises(BlockAllocationError, match=r"needed=2 free=1 \(request 'b'\)$"):
        pool.allocate("b", 5)
    with pytest.raises(BlockAllocationError, match=r"needed=2 free=1 \(request 'a'\)$"):
        pool.append("a", 5)
    assert (free_ids(pool), table(pool, "a"), pool.usage()) == before
    with pytest.raises(KeyError):
        table(pool, "b")


def test_bad_arguments_raise_value_error_or_key_error(make: Factory) -> None:
    pool = make(3, 4)
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match=r"^request already has allocated blocks: a$"):
        pool.allocate("a", 1)
    with pytest.raises(ValueError, match=r"^token_count must be non-negative, got -1$"):
        pool.allocate("b", -1)
    with pytest.raises(ValueError, match=r"^token_count must be non-negative, got -2$"):
        pool.append("a", -2)
    with pytest.raises(KeyError):
        pool.append("missing", 1)
    with pytest.raises(KeyError):
        pool.release("missing")
    assert pool.usage().used_blocks == 1


@pytest.mark.parametrize(("total_blocks", "block_size"), [(0, 16), (4, 0), (-1, -1)])
def test_bad_configuration_is_a_value_error(
    make: Factory, total_blocks: int, block_size: int
) -> None:
    with pytest.raises(ValueError, match="must be at least 1"):
        make(total_blocks, block_size)


def test_can_allocate_says_whether_allocate_would_find_its_blocks() -> None:
    pool = KVBlockManager(3, 4)
    pool.allocate("a", 5)  # blocks 0, 1: one left, 4 tokens' worth
    assert [pool.can_allocate(n) for n in (0, 4, 5)] == [True, True, False]
    pool.release("a")
    assert pool.can_allocate(12) and not pool.can_allocate(13)


@pytest.mark.parametrize("cls", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_a_pool_without_a_block_size_has_blocks_of_16_tokens(
    cls: type[SpecBackedManager | KVCacheManager],
) -> None:
    pool = cls(4)
    assert (pool.block_size, pool.allocate("a", 17).table().block_ids) == (16, (0, 1))


def test_release_of_everything_refills_the_pool(make: Factory) -> None:
    pool = make(5, 2)
    for request_id, tokens in [("a", 3), ("b", 1), ("c", 4)]:
        pool.allocate(request_id, tokens)
    for request_id in ["b", "a", "c"]:
        pool.release(request_id)
    assert sorted(free_ids(pool)) == [0, 1, 2, 3, 4]
    assert pool.usage().used_blocks == 0 and pool.usage().allocated_tokens == 0


def test_append_slot_returns_the_pool_row_of_each_new_token() -> None:
    pool = KVBlockManager(4, 2)
    pool.allocate("x", 1)  # block 0
    pool.allocate("a", 1)  # block 1, token 0 at slot 2
    assert [pool.append_slot("a") for _ in range(3)] == [3, 4, 5]  # block 1 then block 2
    assert pool.snapshot_request("a").block_ids == [1, 2]
    pool.allocate("b", 2)  # block 3
    with pytest.raises(BlockAllocationError, match="needed=1 free=0"):
        pool.append_slot("a")
    assert pool.snapshot_request("a").token_count == 4
    with pytest.raises(KeyError):
        pool.append_slot("missing")


def test_blocks_are_described_by_id_and_capacity() -> None:
    pool = KVBlockManager(3, 8)
    assert [(b.block_id, b.capacity_tokens) for b in pool.blocks] == [(0, 8), (1, 8), (2, 8)]
    assert pool.free_blocks == 3 and pool.can_allocate(24) and not pool.can_allocate(25)


def test_tokens_that_fit_the_last_block_stay_in_it_and_one_more_opens_the_next(
    make: Factory,
) -> None:
    pool = make(4, 4)
    pool.allocate("a", 1)
    assert pool.append("a", 2).table() == RequestBlockTable("a", (0,), 3)
    assert pool.usage().allocated_tokens == 3
    assert pool.append("a", 2).table() == RequestBlockTable("a", (0, 1), 5)  # 1 fits, 1 not
    assert pool.usage().allocated_tokens == 5
