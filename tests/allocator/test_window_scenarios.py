"""KV cache groups and sliding windows with literal block ids, on spec and impl.

The window rule (``spec.growth``): an operation adding tokens to a request whose first
L0 tokens are computed releases, in a group with window W, every block b with
(b + 1) * block_size <= L0 - W + 1, in block index order, before it takes a block.
"""

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import spec
from impl import BlockAllocationError, KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import ReleasedBlocks, RequestBlockTable, next_skip_token_count, skipped_blocks_at
from tests.support.reading import admitted, cached_free_ids, free_ids, ref_count, table

Factory = Callable[[int, int, tuple[int | None, ...]], KVCacheManager]
THIRTEEN = list(range(1, 14))  # three full blocks of 4 and one token


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    cls = request.param

    def factory(
        total_blocks: int, block_size: int, group_windows: tuple[int | None, ...]
    ) -> KVCacheManager:
        pool: KVCacheManager = cls(total_blocks, block_size, group_windows=group_windows)
        return pool

    return factory


def test_decoding_slides_the_window_over_a_block_at_the_exact_step(make: Factory) -> None:
    # Gemma-like: group 0 full attention, group 1 a window of 4 tokens; blocks of 4.
    pool = make(10, 4, (None, 4))
    assert pool.group_windows == (spec.FullAttention(), spec.SlidingWindow(4))
    assert pool.allocate("a", 6).table() == RequestBlockTable("a", (0, 1), 6)
    assert table(pool, "a", 1) == RequestBlockTable("a", (2, 3), 6)
    # L0 = 6: the next query (position 6) reads keys 3..6, so block 0 (tokens 0-3) stays.
    assert pool.append("a", 1).slots[0][0] == 6
    assert table(pool, "a", 1) == RequestBlockTable("a", (2, 3), 7)
    # L0 = 7: (0 + 1) * 4 <= 7 - 4 + 1, so group 1 releases block 2 to the free tail.
    assert pool.append("a", 1).slots[0][0] == 7
    assert table(pool, "a", 1) == RequestBlockTable("a", (3,), 8, skipped_blocks=1)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1), 8)
    assert free_ids(pool) == (4, 5, 6, 7, 8, 9, 2)
    assert pool.take_transfers().skipped_block_ids == (2,)
    assert pool.take_transfers().skipped_block_ids == ()
    # L0 = 8 opens a block in each group, group 0's first.
    assert pool.append("a", 1).slots[0][0] == 16
    assert table(pool, "a", 1) == RequestBlockTable("a", (3, 5), 9, skipped_blocks=1)
    usage = pool.usage()
    assert (usage.used_blocks, usage.reserved_tokens) == (5, 20)
    assert (usage.group_reserved_tokens, usage.skipped_blocks) == ((12, 8), 1)
    assert pool.release("a") == ReleasedBlocks((0, 1, 4, 3, 5), (4, 1, 0, 5, 3), ())


def test_one_append_of_a_chunk_skips_by_the_length_before_it(make: Factory) -> None:
    # Mistral-like: one windowed group. Blocks of 2, window 3.
    pool = make(8, 2, (3,))
    pool.allocate("a", 5)  # blocks 0 1 2; nothing computed, nothing skipped
    # L0 = 5 reads from token 3: blocks 0 (tokens 0-1) go, block 1 (2-3) stays although
    # the chunk's last query (position 8) would not need it.
    assert pool.append("a", 4).table() == RequestBlockTable("a", (1, 2, 3, 4), 9, 1)
    assert pool.take_transfers().skipped_block_ids == (0,)
    # L0 = 9 reads from token 7: blocks 1 and 2 (tokens 2-5) go, in index order.
    assert pool.append("a", 1).table() == RequestBlockTable("a", (3, 4), 10, 3)
    assert free_ids(pool) == (5, 6, 7, 0, 1, 2)
    # A block a window freed and an allocation took is no longer waiting to be poisoned.
    pool.allocate("b", 8)  # 5 6 7 0
    pool.allocate("c", 1)  # 1
    assert pool.take_transfers().skipped_block_ids == (2,)


def test_a_prefix_hit_under_a_window_reuses_only_the_blocks_of_the_window(make: Factory) -> None:
    pool = make(10, 4, (None, 4))
    assert admitted(pool.allocate("a", THIRTEEN)) == (RequestBlockTable("a", (0, 1, 2, 3), 13), 0)
    assert table(pool, "a", 1) == RequestBlockTable("a", (4, 5, 6, 7), 13)
    assert pool.release("a") == ReleasedBlocks((0, 1, 2, 3, 4, 5, 6, 7), (3, 7), (2, 1, 0, 6, 5, 4))
    # A hit of 12 tokens: group 0 needs blocks 0-2, group 1 only the block of tokens 9-11
    # (block 6); its blocks 4 and 5 are born skipped and stay cached free.
    assert admitted(pool.allocate("b", THIRTEEN)) == (RequestBlockTable("b", (0, 1, 2, 8), 13), 12)
    assert table(pool, "b", 1) == RequestBlockTable("b", (6, 9), 13, skipped_blocks=2)
    assert cached_free_ids(pool) == (5, 4)
    assert pool.usage().group_reserved_tokens == (16, 8)
    assert pool.take_transfers().skipped_block_ids == ()  # born skipped blocks were never released


def test_a_windowed_group_hits_past_evicted_blocks_a_full_group_would_need(make: Factory) -> None:
    pool = make(6, 4, (4,))
    pool.allocate("a", THIRTEEN)  # blocks 0 1 2 3; 0 1 2 cached
    # L0 = 13 reads from token 10: blocks 0 and 1 leave the window, cached, in index order.
    assert pool.append("a", [14, 15, 16]).table() == RequestBlockTable("a", (2, 3), 16, 2)
    assert (cached_free_ids(pool), pool.take_transfers().skipped_block_ids) == ((0, 1), ())
    pool.allocate("x", 12)  # takes 4 and 5, then evicts block 0
    assert (cached_free_ids(pool), pool.usage().evictions) == ((1,), 1)
    # The prefix of block index 0 is gone, but a hit of 16 needs only tokens 13..15 in a
    # window of 4: block index 3, block 3, which a still holds. Indices 0-2 are born skipped.
    hit = pool.allocate("b", [*THIRTEEN, 14, 15, 16, 99])
    assert admitted(hit) == (RequestBlockTable("b", (3, 1), 17, 3), 16)
    assert ref_count(pool, 3) == 2


def test_fork_shares_the_held_blocks_and_the_skip_and_each_side_slides_alone(
    make: Factory,
) -> None:
    pool = make(10, 2, (3,))
    pool.allocate("a", 5)  # blocks 0 1 2
    pool.append("a", 1)  # L0 = 5: block 0 goes; a holds 1 2 from index 1
    assert pool.take_transfers().skipped_block_ids == (0,)
    assert pool.fork("a", "b")[0] == RequestBlockTable("b", (1, 2), 6, skipped_blocks=1)
    assert (ref_count(pool, 1), ref_count(pool, 2)) == (2, 2)
    # L0 = 6 for b: block 1 (tokens 2-3) leaves b's window, but a still holds it.
    assert pool.append("b", 1).table() == RequestBlockTable("b", (2, 3), 7, skipped_blocks=2)
    assert (ref_count(pool, 1), pool.take_transfers().skipped_block_ids) == (1, ())
    # When a slides past it too, it is free, and pending.
    assert pool.append("a", 1).table() == RequestBlockTable("a", (2, 4), 7, skipped_blocks=2)
    assert (ref_count(pool, 1), pool.take_transfers().skipped_block_ids) == (0, (1,))


def test_truncate_is_refused_when_a_skipped_block_would_be_read_again(make: Factory) -> None:
    pool = make(8, 4, (None, 4))
    pool.allocate("a", 7)
    pool.append("a", 5)  # L0 = 7: group 1 skips block index 0; a holds 12 tokens
    assert table(pool, "a", 1) == RequestBlockTable("a", (3, 5), 12, skipped_blocks=1)
    before = (free_ids(pool), table(pool, "a"), table(pool, "a", 1))
    message = (
        "cannot truncate request 'a' to 6 tokens: group 1 (window 4) released its first 1 "
        "blocks (4 tokens), and the next token would read from token 3"
    )
    with pytest.raises(ValueError, match=rf"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        pool.truncate("a", 6)
    assert (free_ids(pool), table(pool, "a"), table(pool, "a", 1)) == (before)
    # 7 tokens: the next query (position 7) reads from token 4, past the released block.
    pool.truncate("a", 7)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1), 7)
    assert table(pool, "a", 1) == RequestBlockTable("a", (3,), 7, skipped_blocks=1)
    assert free_ids(pool) == (6, 7, 2, 4, 5)


def test_preempt_releases_every_groups_blocks(make: Factory) -> None:
    pool = make(8, 2, (None, 3))
    pool.allocate("a", [5, 6, 7, 8, 9])  # group 0: 0 1 2; group 1: 3 4 5
    # L0 = 5: group 1 skips block 3, which is cached, so it goes to the cached free queue
    # and is not poisoned. The append fills block index 2: blocks 2 and 5 get cached.
    pool.append("a", [1])
    assert pool.take_transfers().skipped_block_ids == ()
    assert cached_free_ids(pool) == (3,)
    assert pool.preempt("a") == ReleasedBlocks((0, 1, 2, 4, 5), (), (2, 1, 0, 5, 4))
    assert pool.usage().preemptions == 1
    assert pool.usage().group_reserved_tokens == (0, 0)


def test_a_refused_append_counts_blocks_its_skips_would_free_and_changes_nothing(
    make: Factory,
) -> None:
    pool = make(4, 2, (3,))
    pool.allocate("a", 7)  # blocks 0 1 2 3: the pool is full
    # L0 = 7 frees blocks 0 and 1 (tokens 0-3; the next query reads from 5): two free.
    with pytest.raises(BlockAllocationError, match=r"needed=3 free=2 \(request 'a'\)"):
        pool.append("a", 6)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1, 2, 3), 7)
    assert pool.take_transfers().skipped_block_ids == ()
    assert pool.append("a", 4).table() == RequestBlockTable("a", (2, 3, 0, 1), 11, 2)
    assert pool.take_transfers().skipped_block_ids == ()  # both taken again at once


@pytest.mark.parametrize(
    ("group_windows", "error", "message"),
    [
        ((), ValueError, "group_windows must name at least 1 KV cache group, got 0"),
        ((None, 0), ValueError, "window of group 1 must be at least 1 token, got 0"),
        (
            (True,),
            TypeError,
            "window of group 0 must be None, an int or a FullAttention, SlidingWindow or "
            "RecurrentState, got bool True",
        ),
        (4, TypeError, "group_windows must be a tuple, got int 4"),
    ],
)
def test_bad_groups_are_refused_with_the_numbers(
    group_windows: object, error: type[Exception], message: str
) -> None:
    for cls in (KVCacheManager, SpecBackedManager):
        with pytest.raises(error, match=rf"^{message}$"):
            cls(4, 2, group_windows=group_windows)  # type: ignore[arg-type]


def test_a_group_out_of_range_is_refused(make: Factory) -> None:
    pool = make(4, 2, (None, 3))
    pool.allocate("a", 1)
    message = r"^group must be in \[0, 2\) \(the pool has 2 KV cache groups\), got 2$"
    with pytest.raises(ValueError, match=message):
        table(pool, "a", 2)


def test_the_next_skip_of_a_window_is_one_token_after_its_last_query_reading_the_block() -> None:
    # Blocks of 4, a window of 6: block index 0 goes when L0 - 6 + 1 >= 4, at L0 = 9; block
    # index 1 at L0 = 13. Full attention never skips.
    assert [next_skip_token_count(4, skipped, 6) for skipped in (0, 1)] == [9, 13]
    assert next_skip_token_count(4, 0, None) is None


@given(
    block_size=st.integers(1, 8),
    skipped_blocks=st.integers(0, 12),
    window=st.integers(1, 40),
)
def test_the_next_skip_is_the_first_length_at_which_the_window_skips_one_more_block(
    block_size: int, skipped_blocks: int, window: int
) -> None:
    """impl's decode fast path trusts this length: no skip happens before it, one does at it."""
    at = next_skip_token_count(block_size, skipped_blocks, window)
    assert at is not None
    assert skipped_blocks_at(block_size, at - 1, window) <= skipped_blocks
    assert skipped_blocks_at(block_size, at, window) == skipped_blocks + 1


def test_a_decode_slot_past_skipped_blocks_is_in_the_tables_own_block(make: Factory) -> None:
    pool = make(8, 2, (3,))
    pool.allocate("a", 7)  # blocks 0..3
    assert pool.append("a", 1).slots[0][0] == 7  # token 7: block index 3 (block 3), offset 1
    assert table(pool, "a") == RequestBlockTable("a", (2, 3), 8, skipped_blocks=2)
    assert pool.append("a", 1).slots[0][0] == 8  # token 8 opens block index 4: block 4
    assert table(pool, "a") == RequestBlockTable("a", (3, 4), 9, skipped_blocks=3)


def test_a_table_that_skipped_a_block_opens_only_the_block_it_needs(make: Factory) -> None:
    pool = make(8, 4, (3,))
    pool.allocate("a", 7)  # blocks 0 and 1
    assert pool.append("a", 1).table() == RequestBlockTable("a", (1,), 8, skipped_blocks=1)
    # Token 8 opens block index 2 before the next skip (at length 10): one block, 2.
    assert pool.append("a", 1).table() == RequestBlockTable("a", (1, 2), 9, skipped_blocks=1)
    assert pool.usage().free_blocks == 6


def test_a_windowed_hit_falls_back_one_block_at_a_time(make: Factory) -> None:
    pool = make(8, 2, (8,))
    pool.allocate("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0..2 cached, 3 holds 7
    # Four blocks could hit; the fourth (7, 8) is not cached, the first three are.
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 6


def test_a_windowed_hit_needs_every_block_its_window_reads(make: Factory) -> None:
    pool = make(8, 2, (5,))
    pool.allocate("a", list(range(1, 10)))  # blocks 0..3 cached, 4 holds 9
    pool.append("a", [10])
    pool.append("a", [11, 12])  # blocks 0, 1, 2 left the window: cached free
    pool.allocate("x", 10)  # takes 6 and 7, then evicts 0, 1 and 2
    # 1..8 would need blocks 2 and 3 (a window of 5 at length 8 reads tokens 4..7);
    # block 3 is cached, 2 is not: no hit at all.
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 99, 98]) == 0


def test_the_spec_records_table_in_a_window_group_keeps_its_skipped_blocks() -> None:
    state = spec.init(8, 2, (None, 2))
    state, _ = spec.api.allocate(state, "a", 3)  # group 0: [0, 1]; group 1: [2, 3]
    _, step = spec.api.append(state, "a", 2)
    assert step.table(1) == spec.RequestBlockTable("a", (3, 5), 5, skipped_blocks=1)
    assert step.table() == spec.RequestBlockTable("a", (0, 1, 4), 5)
