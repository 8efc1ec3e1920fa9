"""Prefix caching, eviction, fork and copy-on-write with literal block ids, on spec and impl."""

from collections.abc import Callable

import pytest

from impl import BlockAllocationError, KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import ReleasedBlocks, RequestBlockTable
from spec.invariants import violated_invariants
from tests.support.reading import admitted, cached_free_ids, free_ids, table

Factory = Callable[[int, int], KVCacheManager]
TEN = list(range(1, 11))  # a 10-token prompt: two full blocks of 4 and half a third


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    factory: Factory = request.param
    return factory


def test_a_shared_prefix_reuses_the_cached_full_blocks(make: Factory) -> None:
    pool = make(8, 4)
    assert admitted(pool.allocate("a", TEN)) == (RequestBlockTable("a", (0, 1, 2), 10), 0)
    # Same first 8 tokens, then a different tail: blocks 0 and 1 are shared.
    b = pool.allocate("b", [*TEN[:8], 20, 21, 22])
    assert admitted(b) == (RequestBlockTable("b", (0, 1, 3), 11), 8)
    usage = pool.usage()
    assert (usage.used_blocks, usage.shared_blocks, usage.prefix_hit_tokens) == (4, 2, 8)
    assert usage.cached_blocks == 2


def test_a_hit_never_covers_the_prompts_last_token(make: Factory) -> None:
    pool = make(8, 4)
    pool.allocate("a", TEN)
    # Exactly the 8 cached tokens: only block 0 is reused; the last block is recomputed.
    assert pool.allocate("b", TEN[:8]).table().block_ids == (0, 3)
    assert pool.usage().cached_blocks == 2  # block 3 duplicates block 1 and is not cached


def test_released_prefix_blocks_stay_findable_and_are_revived(make: Factory) -> None:
    pool = make(8, 4)
    pool.allocate("a", TEN)
    assert pool.release("a").block_ids == (0, 1, 2)
    # Block 2 held no full block: plain free. Blocks 1, 0 keep their prefix: cached free.
    assert free_ids(pool) == (3, 4, 5, 6, 7, 2)
    assert cached_free_ids(pool) == (1, 0)
    again = pool.allocate("c", TEN)
    assert admitted(again) == (RequestBlockTable("c", (0, 1, 3), 10), 8)
    assert not cached_free_ids(pool)


def test_plain_free_blocks_go_first_then_the_least_recently_freed_cached_one(
    make: Factory,
) -> None:
    pool = make(4, 2)
    pool.allocate("a", [1, 2, 3])  # blocks 0 (cached: 1, 2) and 1
    pool.allocate("b", [7, 8, 9])  # blocks 2 (cached: 7, 8) and 3
    pool.release("a")
    pool.release("b")
    assert (free_ids(pool), cached_free_ids(pool)) == ((1, 3), (0, 2))
    assert pool.allocate("c", 6).table().block_ids == (1, 3, 0)  # block 0 evicted, 2 still cached
    assert pool.usage().evictions == 1
    pool.release("c")
    assert free_ids(pool)[:3] == (0, 3, 1)  # block 0 lost its prefix when it was evicted
    revived = pool.allocate("d", [7, 8, 5])
    assert admitted(revived) == (RequestBlockTable("d", (2, 0), 3), 2)


def test_fork_shares_blocks_and_the_first_writer_copies_the_partial_one(make: Factory) -> None:
    pool = make(6, 4)
    pool.allocate("p", [1, 2, 3, 4, 5, 6])  # block 0 full, block 1 holds 2 tokens
    assert pool.fork("p", "c")[0] == RequestBlockTable("c", (0, 1), 6)
    assert pool.usage().shared_blocks == 2
    # The child writes into the shared partial block: it gets a copy, block 2.
    assert pool.append("c", [7]).table() == RequestBlockTable("c", (0, 2), 7)
    assert pool.take_transfers().copies == ((1, 2),)
    # Block 1 is the parent's alone now: it writes in place, nothing to copy.
    assert pool.append("p", [9]).table() == RequestBlockTable("p", (0, 1), 7)
    assert pool.take_transfers().copies == ()
    assert pool.usage().cow_copies == 1 and pool.usage().shared_blocks == 1


def test_a_copy_on_write_append_that_also_opens_a_block_takes_both(make: Factory) -> None:
    pool = make(6, 4)
    pool.allocate("p", 6)  # block 0 full, block 1 holds 2 tokens
    pool.fork("p", "c")
    # 3 tokens: 2 fill the copy of block 1 (block 2), the third opens block 3.
    assert pool.append("c", 3).table() == RequestBlockTable("c", (0, 2, 3), 9)
    assert pool.take_transfers().copies == ((1, 2),)
    assert free_ids(pool) == (4, 5)


def test_a_pending_copy_into_a_released_block_is_dropped_and_one_from_it_is_kept(
    make: Factory,
) -> None:
    pool = make(6, 4)
    pool.allocate("p", 6)  # block 0 full, block 1 holds 2 tokens
    pool.fork("p", "c")
    pool.fork("p", "d")
    pool.append("c", 1)  # copies block 1 into block 2
    pool.append("d", 1)  # copies block 1 into block 3
    assert pool.to_spec().pending_copies == ((1, 2), (1, 3))
    pool.release("c")  # block 2, the first copy's destination, is free: its copy is moot
    assert list(pool.to_spec().pending_copies) == [(1, 3)]
    pool.release("p")  # block 1, the source, is free but unwritten until the next forward
    assert free_ids(pool) == (4, 5, 2, 1)
    assert pool.take_transfers().copies == ((1, 3),)


def test_a_recomputed_request_shares_blocks_reached_through_an_equal_duplicate(
    make: Factory,
) -> None:
    # Found by scripts/fuzz.sh: "r0" filled a duplicate of "r1"'s cached block 0, forked
    # "r2", and was recomputed after preemption. Its prompt hits block 0 for (0, 0), then
    # blocks 3 and 4 that it computed before and "r2" still holds behind block 1, a
    # duplicate of block 0. Sharing over equal tokens in different blocks is sound.
    pool = make(7, 2)
    for request_id in ("r1", "r0"):
        pool.allocate(request_id, [])
        pool.append(request_id, [0])
    pool.append("r1", [0, 0])
    for _ in range(3):
        pool.append("r0", [0, 0])
    pool.fork("r0", "r2")
    pool.append("r0", [0])
    pool.append("r2", [0])
    pool.preempt("r0")
    assert admitted(pool.allocate("r0", [0] * 8)) == (RequestBlockTable("r0", (0, 3, 4, 6), 8), 6)
    assert table(pool, "r2") == RequestBlockTable("r2", (1, 3, 4, 5), 8)
    assert violated_invariants(pool.to_spec()) == []


def test_a_refused_copy_on_write_changes_nothing(make: Factory) -> None:
    pool = make(2, 4)
    pool.allocate("p", 6)  # blocks 0, 1: the pool is full
    pool.fork("p", "c")
    with pytest.raises(BlockAllocationError, match=r"needed=1 free=0 \(request 'c'\)"):
        pool.append("c", 1)
    assert pool.take_transfers().copies == ()
    assert pool.usage().cow_copies == 0 and pool.usage().shared_blocks == 2
    pool.release("p")  # now block 1 is the child's alone: no copy needed
    assert pool.append("c", 2).table() == RequestBlockTable("c", (0, 1), 8)


def test_preemption_releases_and_recompute_hits_its_own_blocks(make: Factory) -> None:
    pool = make(4, 4)
    pool.allocate("a", TEN)
    assert pool.preempt("a") == ReleasedBlocks((0, 1, 2), (2,), (1, 0))
    readmitted = pool.allocate("a", TEN)
    assert admitted(readmitted) == (RequestBlockTable("a", (0, 1, 3), 10), 8)
    assert pool.usage().preemptions == 1


def test_the_wrong_kind_of_append_is_a_value_error(make: Factory) -> None:
    pool = make(4, 4)
    pool.allocate("counted", 2)
    pool.allocate("tracked", [1, 2])
    with pytest.raises(ValueError, match="tracks token ids"):
        pool.append("tracked", 1)
    with pytest.raises(ValueError, match="allocated by count"):
        pool.append("counted", [3])
    with pytest.raises(ValueError, match=r"^request already has allocated blocks: tracked$"):
        pool.fork("counted", "tracked")
    with pytest.raises(KeyError):
        pool.fork("missing", "new")


def test_a_hash_collision_is_no_hit() -> None:
    # Every block hashes alike; hits must still need equal token ids.
    pool = KVCacheManager(8, 2, block_hash=lambda parent_hash, token_ids: 0)
    pool.allocate("a", [1, 2, 3])
    assert pool.allocate("b", [5, 6, 7]).cached_tokens == 0
    assert pool.allocate("c", [1, 2, 9]).cached_tokens == 2
    pool.check_invariants()


def _same_prompts_on_the_spec(prompts: dict[str, list[int]]) -> SpecBackedManager:
    driver = SpecBackedManager(8, 2)
    for request_id, token_ids in prompts.items():
        driver.allocate(request_id, token_ids)
    return driver


def test_a_hit_behind_another_entry_of_a_colliding_bucket_is_found() -> None:
    # Every block hashes alike: blocks 0 = (1, 2) and 2 = (5, 6), both at a prompt's start,
    # share one bucket, and the match for "c" is the second entry.
    pool = KVCacheManager(8, 2, block_hash=lambda parent_hash, token_ids: 0)
    prompts = {"a": [1, 2, 3], "b": [5, 6, 7], "c": [5, 6, 9]}
    for request_id, token_ids in prompts.items():
        allocation = pool.allocate(request_id, token_ids)
    assert admitted(allocation) == (RequestBlockTable("c", (2, 4), 3), 2)
    assert pool.to_spec() == _same_prompts_on_the_spec(prompts).state
    pool.check_invariants()


def test_equal_tokens_under_another_parent_are_no_hit() -> None:
    # A hash that ignores the parent: (5, 6) as a prompt's first block and as its second
    # collide, and only the token-by-token prefix check tells them apart.
    pool = KVCacheManager(8, 2, block_hash=lambda parent_hash, token_ids: hash(token_ids))
    prompts = {"a": [1, 2, 9], "b": [5, 6, 9], "c": [1, 2, 5, 6, 9]}
    for request_id, token_ids in prompts.items():
        allocation = pool.allocate(request_id, token_ids)
    assert admitted(allocation) == (RequestBlockTable("c", (0, 4, 5), 5), 2)
    assert pool.to_spec() == _same_prompts_on_the_spec(prompts).state
    pool.check_invariants()


def test_equal_tokens_behind_another_first_block_are_cached_apart_and_hit_apart() -> None:
    # A hash that ignores the parent: (9, 9) behind (1, 2) and behind (5, 6) collide, and
    # the prefix check walks both chains to their first blocks, which differ. So b's (9, 9)
    # is cached as its own block 4, and c, behind b's first block, hits block 4, not a's 1.
    pool = KVCacheManager(8, 2, block_hash=lambda parent_hash, token_ids: hash(token_ids))
    prompts = {"a": [1, 2, 9, 9, 3], "b": [5, 6, 9, 9, 3], "c": [5, 6, 9, 9, 4]}
    for request_id, token_ids in prompts.items():
        allocation = pool.allocate(request_id, token_ids)
    assert admitted(allocation) == (RequestBlockTable("c", (3, 4, 6), 5), 4)
    assert pool.to_spec() == _same_prompts_on_the_spec(prompts).state
    pool.check_invariants()


def test_decode_appends_cache_the_block_they_fill() -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", [1])
    assert pool.append("a", [2]).slots[0][0] == 1  # fills block 0: cached as (1, 2)
    pool.release("a")
    assert cached_free_ids(pool) == (0,)
    assert pool.allocate("b", [1, 2, 3]).cached_tokens == 2


def test_a_prefix_cache_reset_frees_cached_blocks_in_order_and_uncaches_held_ones(
    make: Factory,
) -> None:
    pool = make(8, 2)
    pool.allocate("a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached (8 blocks of 2)
    pool.allocate("b", [7, 7, 7])  # blocks 3, 4; block 3 cached
    pool.release("a")  # 2 free; 1, 0 cached free
    assert (free_ids(pool), cached_free_ids(pool)) == ((5, 6, 7, 2), (1, 0))
    assert pool.reset_prefix_cache() == 3
    assert (free_ids(pool), cached_free_ids(pool)) == ((5, 6, 7, 2, 1, 0), ())
    assert pool.usage().cached_blocks == 0
    # Block 3 is still b's, with its K/V, but no prompt hits it any more.
    assert pool.allocate("c", [7, 7, 7]).cached_tokens == 0
    assert table(pool, "b").block_ids == (3, 4)


def test_a_copy_into_a_block_released_cached_before_the_copy_is_taken_is_dropped(
    make: Factory,
) -> None:
    pool = make(4, 2)
    pool.allocate("a", [1, 2, 3])  # blocks 0 (1..2, cached) and 1 (3)
    pool.fork("a", "b")
    pool.append("b", [4])  # b copies block 1 into 2, which 3..4 fill: cached
    assert pool.to_spec().pending_copies == ((1, 2),)
    pool.release("b")  # 2 goes to the cached free queue, nobody holding it
    assert cached_free_ids(pool) == (2,)
    assert pool.take_transfers().copies == ()


def test_appending_no_tokens_to_a_shared_partly_filled_block_copies_nothing(
    make: Factory,
) -> None:
    pool = make(4, 2)
    pool.allocate("a", 3)  # blocks 0 and 1 (token 3)
    pool.fork("a", "b")
    assert pool.append("b", 0).table() == RequestBlockTable("b", (0, 1), 3)
    assert pool.to_spec().pending_copies == ()
    assert pool.usage().cow_copies == 0


def test_a_fork_of_an_empty_request_grows_by_no_tokens_then_by_one(make: Factory) -> None:
    pool = make(4, 2)
    pool.allocate("a", 0)
    pool.fork("a", "b")
    assert pool.append("b", 0).table() == RequestBlockTable("b", (), 0)
    assert pool.append("b", 1).table() == RequestBlockTable("b", (0,), 1)


def test_a_window_can_unshare_one_group_s_last_block_and_only_the_shared_ones_are_copied(
    make: Callable[..., KVCacheManager],
) -> None:
    # A full group and a window of 1, blocks of 2: r0 at 2 tokens (blocks 0 and 1), forked
    # to r1, rolled back to 1 token: its last block is partly filled and shared in both.
    pool = make(8, 2, group_windows=(None, 1))
    pool.allocate("r0", (0, 0))
    pool.fork("r0", "r1")
    pool.truncate("r0", 1)
    # r1's next token leaves the window past its first block: group 1 drops block 1, which
    # r0 now holds alone, while group 0's block 0 stays shared.
    pool.append("r1", (0,))
    assert table(pool, "r1", 1) == RequestBlockTable("r1", (3,), 3, skipped_blocks=1)
    # r0 writes into its last blocks and opens new ones: group 0's last block is copied
    # (into 4, then 5 opens), group 1's written in place (then 6 opens).
    pool.append("r0", (5, 6))
    assert table(pool, "r0", 0) == RequestBlockTable("r0", (4, 5), 3)
    assert table(pool, "r0", 1) == RequestBlockTable("r0", (1, 6), 3)
    assert pool.take_transfers().copies == ((0, 4),)
