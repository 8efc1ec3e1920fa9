"""The named invariants reject the broken states they exist for.

The state machine and the bounded checker only ever show them sound states, so without
these a predicate that always said "fine" would pass everything (mutation testing found
exactly that gap). Each state below is hand-built and breaks one rule.
"""

from collections.abc import Callable
from dataclasses import replace

import pytest

import spec
from impl import KVCacheManager
from impl.checking import check_indexes
from spec import (
    AllocatorState,
    CacheKey,
    FrozenMap,
    KVBlockUsage,
    RequestBlockTable,
    SharingCounters,
)
from spec.api import OPERATIONS
from spec.invariants import (
    is_cache_sound,
    is_cached_content_exact,
    is_conserved,
    is_grouped_consistently,
    is_keyed_by_request_id,
    is_partitioned,
    is_salt_isolated,
    is_shared_only_over_a_common_prefix,
    is_skipped_pending_free,
    is_tightly_sized,
    is_token_tracking_sound,
    is_usage_consistent,
    is_window_readable,
    is_window_tight,
    violated_invariants,
)


def pool(
    free: tuple[int, ...], *tables: RequestBlockTable, keys: tuple[str, ...] = ()
) -> AllocatorState:
    """A 4-block pool of 2-token blocks with the given free queue and tables."""
    names = keys or tuple(table.request_id for table in tables)
    ref_counts: dict[int, int] = {}
    for table in tables:
        for block_id in table.block_ids:
            ref_counts[block_id] = ref_counts.get(block_id, 0) + 1
    return AllocatorState(
        2,
        4,
        free,
        (FrozenMap(dict(zip(names, tables, strict=True))),),
        cached_free_block_ids=(),
        ref_counts=FrozenMap(ref_counts),
        token_ids=FrozenMap({}),
        group_caches=(FrozenMap({}),),
        pending_copies=(),
        counters=SharingCounters(),
    )


def with_tables(state: AllocatorState, tables: FrozenMap[str, RequestBlockTable]) -> AllocatorState:
    """``state`` with group 0's tables replaced."""
    return replace(state, group_tables=(tables, *state.group_tables[1:]))


def unsalted(*token_ids: int) -> CacheKey:
    """The cache key of a prefix cached with no salt."""
    return CacheKey(None, token_ids)


def with_cache(state: AllocatorState, cache: FrozenMap[CacheKey, int]) -> AllocatorState:
    """``state`` with group 0's prefix cache replaced."""
    return replace(state, group_caches=(cache, *state.group_caches[1:]))


SOUND = pool((3,), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2))


def test_a_sound_state_breaks_no_invariant() -> None:
    assert violated_invariants(SOUND) == []
    assert is_usage_consistent(SOUND, spec.usage(SOUND))


def test_a_lost_block_breaks_conservation_and_partition() -> None:
    leaked = pool((), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2))
    assert not is_conserved(leaked)
    assert violated_invariants(leaked) == ["conservation", "partition"]


def test_a_block_both_free_and_held_breaks_partition_only() -> None:
    # Four places for four blocks, so the count adds up; block 2 is in two of them.
    twice = pool((2,), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2))
    assert is_conserved(twice)
    assert not is_partitioned(twice)
    assert violated_invariants(twice) == ["partition"]


def test_a_block_id_out_of_range_breaks_partition() -> None:
    stray = pool((4,), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2))
    assert violated_invariants(stray) == ["partition"]


def test_a_table_with_a_spare_block_breaks_tight_sizing() -> None:
    spare = pool((), RequestBlockTable("a", (0, 1, 3), 3), RequestBlockTable("b", (2,), 2))
    assert not is_tightly_sized(spare)
    assert violated_invariants(spare) == ["tight_sizing"]


def test_a_table_missing_a_block_breaks_tight_sizing() -> None:
    short = pool((1, 3), RequestBlockTable("a", (0,), 3), RequestBlockTable("b", (2,), 2))
    assert violated_invariants(short) == ["tight_sizing"]


def test_a_negative_token_count_breaks_tight_sizing_without_raising() -> None:
    negative = pool((0, 1, 3), RequestBlockTable("b", (2,), 2), RequestBlockTable("c", (), -1))
    assert not is_tightly_sized(negative)


def test_a_table_filed_under_another_id_breaks_keyed_by_request_id() -> None:
    misfiled = pool(
        (3,), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2), keys=("a", "x")
    )
    assert not is_keyed_by_request_id(misfiled)
    assert violated_invariants(misfiled) == ["keyed_by_request_id"]


def test_a_usage_report_with_wrong_token_counts_is_inconsistent() -> None:
    report = spec.usage(SOUND)
    wrong = KVBlockUsage(
        block_size=report.block_size,
        total_blocks=report.total_blocks,
        used_blocks=report.used_blocks,
        free_blocks=report.free_blocks,
        request_count=report.request_count,
        allocated_tokens=report.allocated_tokens + 1,
        reserved_tokens=report.reserved_tokens,
    )
    assert not is_usage_consistent(SOUND, wrong)


def test_a_usage_report_of_a_leaky_state_is_inconsistent_even_if_it_matches_the_tables() -> None:
    leaked = pool((), RequestBlockTable("a", (0, 1), 3), RequestBlockTable("b", (2,), 2))
    # Computed from the tables, so it matches them, but used + free is 3 of 4 blocks.
    assert not is_usage_consistent(leaked, spec.usage(leaked))


# "a" holds blocks 0 and 1 for the prompt (1, 2, 3); block 0 is cached as (1, 2).
PROMPTED = spec.allocate(spec.init(4, 2), "a", (1, 2, 3))
# The same after "a" let go: block 0 is a cached free block, 1 a plain free one.
RELEASED = spec.release(PROMPTED, "a")


def test_the_sharing_states_the_broken_ones_start_from_are_sound() -> None:
    assert violated_invariants(PROMPTED) == violated_invariants(RELEASED) == []
    assert (PROMPTED.cache, RELEASED.cached_free_block_ids) == (
        FrozenMap({unsalted(1, 2): 0}),
        (0,),
    )


def test_a_table_holding_a_block_cached_under_another_salt_breaks_salt_isolation() -> None:
    assert is_salt_isolated(PROMPTED)
    # Block 0 of "a" (no salt) recached under tenant t1's salt.
    assert not is_salt_isolated(with_cache(PROMPTED, FrozenMap({CacheKey("t1", (1, 2)): 0})))
    # A salt for a request with no token ids.
    assert not is_salt_isolated(replace(PROMPTED, cache_salts=FrozenMap({"ghost": "t1"})))


def test_token_ids_of_a_request_without_a_table_break_token_tracking() -> None:
    ghost = replace(PROMPTED, token_ids=FrozenMap({**PROMPTED.token_ids, "ghost": (1,)}))
    assert not is_token_tracking_sound(ghost)


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        (
            with_cache(PROMPTED, FrozenMap({unsalted(1, 2): 0, unsalted(1, 2, 5, 6): 0})),
            "one block a key",
        ),
        (with_cache(PROMPTED, FrozenMap({unsalted(1): 0})), "keys are whole blocks"),
        (with_cache(PROMPTED, FrozenMap({unsalted(): 0})), "keys are not empty"),
        (with_cache(RELEASED, FrozenMap({})), "a cached free block is cached"),
        (with_cache(PROMPTED, FrozenMap({unsalted(1, 2): 2})), "a plain free block is not"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_broken_cache_rule_breaks_cache_soundness(broken: AllocatorState, rule: str) -> None:
    assert not is_cache_sound(broken), rule


# "a" holds blocks 0 and 1 for (1, 2, 3, 4, 5); (1, 2) -> 0 and (1, 2, 3, 4) -> 1 cached.
TWO_CACHED = spec.allocate(spec.init(4, 2), "a", (1, 2, 3, 4, 5))
# "b" = (1, 2, 7) shares "a"'s first block 0 and holds block 2 of its own.
SHARING = spec.allocate(PROMPTED, "b", (1, 2, 7))


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        (replace(PROMPTED, token_ids=FrozenMap({})), "a table holding a cached block tracks ids"),
        (
            with_cache(PROMPTED, FrozenMap({unsalted(1, 2, 3, 4): 0})),
            "a block sits where its key ends",
        ),
        # Block 0 of "a" is not cached; block 1's key is not "a"'s first four tokens.
        (with_cache(TWO_CACHED, FrozenMap({unsalted(9, 9, 3, 4): 1})), "the tokens equal the key"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_broken_content_rule_breaks_cached_content_exactness(
    broken: AllocatorState, rule: str
) -> None:
    assert violated_invariants(TWO_CACHED) == []
    assert not is_cached_content_exact(broken), rule


def test_sharing_a_block_at_another_place_or_over_other_tokens_is_broken() -> None:
    assert violated_invariants(SHARING) == []
    assert SHARING.tables["b"].block_ids == (0, 2)
    elsewhere = RequestBlockTable("b", (2, 0), 3)
    moved = with_tables(SHARING, FrozenMap({**SHARING.tables, "b": elsewhere}))
    assert not is_shared_only_over_a_common_prefix(moved)
    other_tokens = FrozenMap({**SHARING.token_ids, "b": (5, 6, 7)})
    assert not is_shared_only_over_a_common_prefix(replace(SHARING, token_ids=other_tokens))


def test_tables_by_count_sharing_a_later_block_over_other_blocks_before_it_are_broken() -> None:
    forked = spec.fork(spec.allocate(spec.init(4, 2), "a", 3), "a", "c")  # both hold (0, 1)
    assert violated_invariants(forked) == []
    other_first_block = RequestBlockTable("c", (3, 1), 3)
    broken = with_tables(forked, FrozenMap({**forked.tables, "c": other_first_block}))
    assert not is_shared_only_over_a_common_prefix(broken)


def test_a_broken_pair_by_count_is_found_after_a_sound_pair_by_count() -> None:
    forked = spec.fork(spec.allocate(spec.init(4, 2), "a", 3), "a", "c")  # both hold (0, 1)
    intruder = RequestBlockTable("b", (2, 1), 3)  # block 1 behind block 2, not block 0
    tables = FrozenMap({**forked.tables, "b": intruder})
    assert not is_shared_only_over_a_common_prefix(with_tables(forked, tables))


def test_token_tables_may_share_a_later_block_over_other_blocks_with_equal_tokens() -> None:
    forked = spec.fork(PROMPTED, "a", "c")  # both hold (0, 1) and track (1, 2, 3)
    assert violated_invariants(forked) == []
    # Block 3 holding the same tokens (1, 2) as block 0: what a prefix hit can produce.
    duplicate_first_block = RequestBlockTable("c", (3, 1), 3)
    equal = with_tables(forked, FrozenMap({**forked.tables, "c": duplicate_first_block}))
    assert is_shared_only_over_a_common_prefix(equal)


def test_a_broken_pair_is_found_after_a_pair_sharing_nothing() -> None:
    apart = RequestBlockTable("c", (3,), 1)
    elsewhere = RequestBlockTable("b", (2, 0), 3)
    tables = FrozenMap({"c": apart, "a": SHARING.tables["a"], "b": elsewhere})
    assert not is_shared_only_over_a_common_prefix(with_tables(SHARING, tables))


def test_tokens_are_compared_only_when_both_sharing_tables_track_them() -> None:
    a_only = FrozenMap({"a": SHARING.token_ids["a"]})
    assert is_shared_only_over_a_common_prefix(replace(SHARING, token_ids=a_only))


def test_slot_index_refuses_a_negative_position_with_the_number() -> None:
    with pytest.raises(ValueError, match=r"^position must be >= 0, got -1$"):
        spec.slot_index(2, (0,), -1)


def test_spec_append_grows_a_table_by_a_count() -> None:
    state = spec.allocate(spec.init(2, 2), "a", 2)
    assert spec.append(state, "a", 1).tables["a"] == RequestBlockTable("a", (0, 1), 3)


def test_the_impl_check_names_the_invariants_a_lost_free_block_breaks() -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", 3)
    pool._pool.free.pop()  # corrupt it the way a leak would
    with pytest.raises(AssertionError, match=r"^allocator invariants broken: conservation, "):
        pool.check_invariants()


def test_the_impl_check_catches_a_drifted_counter() -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", 3)
    pool._pool.shared_blocks += 1
    with pytest.raises(AssertionError, match=r"^allocator invariants broken: usage counters: "):
        pool.check_invariants()


@pytest.mark.parametrize("check", [KVCacheManager.check_invariants, check_indexes])
def test_the_impl_check_catches_a_cached_block_missing_from_its_hash_bucket(
    check: Callable[[KVCacheManager], None],
) -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", [1, 2, 3])
    cache = pool._pool.caches[0]
    key = cache.block_keys[0]
    assert key is not None
    cache.buckets[key.hash_value].remove(0)  # still keyed and counted, no longer findable
    with pytest.raises(
        AssertionError,
        match=r"^allocator invariants broken: cache index: hash buckets, block keys and count "
        r"disagree$",
    ):
        check(pool)


def test_the_index_check_leaves_the_spec_invariants_to_check_invariants() -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", 3)
    pool._pool.free.pop()  # a leak: the spec state breaks conservation, the index is sound
    check_indexes(pool)


@pytest.mark.parametrize("check", [KVCacheManager.check_invariants, check_indexes])
def test_the_impl_check_passes_a_sound_pool(check: Callable[[KVCacheManager], None]) -> None:
    pool = KVCacheManager(4, 2)
    pool.allocate("a", [1, 2, 3])
    check(pool)


# -- KV cache groups and sliding windows --------------------------------------------------

# Blocks of 2, group 0 full, group 1 a window of 3. "a" holds 7 tokens: group 0 blocks
# 0 1 2 6; group 1 appended at L0 = 6 (reads from token 4): blocks 3 4 skipped, holds 5 7.
WINDOWED = spec.append(spec.allocate(spec.init(10, 2, (None, 3)), "a", 6), "a", 1)


def with_group_table(state: AllocatorState, group: int, table: RequestBlockTable) -> AllocatorState:
    tables = list(state.group_tables)
    tables[group] = tables[group].set(table.request_id, table)
    return replace(state, group_tables=tuple(tables))


def test_the_windowed_state_is_sound_and_tight_at_its_l0() -> None:
    assert violated_invariants(WINDOWED) == []
    assert WINDOWED.group_tables[1]["a"] == RequestBlockTable("a", (5, 7), 7, skipped_blocks=2)
    assert is_window_tight(WINDOWED, "a", 6)
    assert WINDOWED.pending_skipped_block_ids == (3, 4)


def test_a_block_kept_past_its_window_or_skipped_early_is_not_tight() -> None:
    assert not is_window_tight(WINDOWED, "a", 8)  # at L0 = 8 block index 2 is out too
    assert not is_window_tight(WINDOWED, "a", 5)  # at L0 = 5 block index 1 is still read


def test_a_table_that_skipped_a_block_the_next_query_reads_is_a_hole_read() -> None:
    hole = with_group_table(WINDOWED, 1, RequestBlockTable("a", (7,), 7, skipped_blocks=3))
    assert not is_window_readable(hole)


def test_a_full_attention_table_that_skips_a_block_reads_a_hole() -> None:
    skipping_full = with_group_table(WINDOWED, 0, RequestBlockTable("a", (1, 2, 6), 7, 1))
    assert is_grouped_consistently(skipping_full)
    assert not is_window_readable(skipping_full)


def test_groups_that_disagree_on_requests_or_counts_are_inconsistent() -> None:
    longer = with_group_table(WINDOWED, 1, RequestBlockTable("a", (5, 7), 8, skipped_blocks=2))
    assert not is_grouped_consistently(longer)
    both_groups = with_group_table(WINDOWED, 1, RequestBlockTable("a", (6, 7), 7, 2))
    assert not is_grouped_consistently(both_groups)


def test_a_state_without_a_table_and_a_cache_per_group_is_checked_no_further() -> None:
    two_groups = spec.init(4, 2, (None, 2))
    one_window = replace(two_groups, group_windows=(spec.FullAttention(),))  # two tables and caches
    one_cache = replace(two_groups, group_caches=two_groups.group_caches[:1])
    one_table = replace(two_groups, group_tables=two_groups.group_tables[:1])
    for broken in (one_window, one_cache, one_table):
        assert not is_grouped_consistently(broken)
        assert violated_invariants(broken) == ["grouped_consistently"]
    # The rules that pair the groups' lists refuse to pair lists of other lengths.
    with pytest.raises(ValueError, match="zip"):
        is_window_readable(one_window)
    for pairs_tables_and_caches in (is_cached_content_exact, is_salt_isolated):
        with pytest.raises(ValueError, match="zip"):
            pairs_tables_and_caches(one_cache)
    for pairs_kinds_and_tables in (is_tightly_sized, is_shared_only_over_a_common_prefix):
        with pytest.raises(ValueError, match="zip"):
            pairs_kinds_and_tables(one_table)


def test_a_pending_skipped_block_that_is_not_free_or_listed_twice_is_broken() -> None:
    assert not is_skipped_pending_free(replace(WINDOWED, pending_skipped_block_ids=(3, 5)))
    assert not is_skipped_pending_free(replace(WINDOWED, pending_skipped_block_ids=(3, 3)))


def test_sizing_counts_the_skipped_blocks() -> None:
    short = with_group_table(WINDOWED, 1, RequestBlockTable("a", (5, 7), 7, skipped_blocks=1))
    assert not is_tightly_sized(short)


def _run(state: AllocatorState, *steps: tuple[object, ...]) -> AllocatorState:
    for operation, *args in steps:
        state, _ = OPERATIONS[str(operation)].transition(state, *args)
    return state


def _forks_that_both_slid(window: int) -> AllocatorState:
    """Block size 2, window ``window``: "a" forked into "b" after sliding past two blocks,
    then each appended a token, sliding past a third and opening a block of its own."""
    state = _run(spec.init(16, 2, (window,)), ("allocate", "a", 9), ("append", "a", 1))
    state = _run(state, ("fork", "a", "b"), ("append", "a", 1), ("append", "b", 1))
    assert [t.skipped_blocks for t in state.tables.values()] == [3, 3]
    return state


def _a_shorter_sharer(truncated: str) -> AllocatorState:
    """ "a" (tokens 1..4) forked into "b"; one of them truncated into the shared block 1."""
    state = _run(spec.init(8, 2), ("allocate", "a", (1, 2, 3, 4)), ("fork", "a", "b"))
    return _run(state, ("truncate", truncated, 3))


@pytest.mark.parametrize(
    "state",
    [
        # A cached key of one token: blocks of one token.
        _run(spec.init(4, 1), ("allocate", "a", (1, 2, 3))),
        # A salted table's last block, not full, is in no cache.
        _run(spec.init(4, 2), ("allocate", "a", (1, 2, 3), "s")),
        # Skipped blocks exactly up to the first token the window reads (4 = 6 - 3 + 1).
        _run(
            spec.init(8, 2, (3,)),
            ("allocate", "a", 7),
            ("append", "a", 1),
            ("truncate", "a", 6),
        ),
        # Cached blocks of a table that skipped some: each keyed by its block index.
        _run(
            spec.init(8, 2, (3,)),
            ("allocate", "a", (1, 2, 3, 4, 5, 6, 7)),
            ("append", "a", (8,)),
        ),
        _forks_that_both_slid(5),
        _a_shorter_sharer("a"),
        _a_shorter_sharer("b"),
    ],
    ids=[
        "one-token-keys",
        "salted-partial-block",
        "window-edge",
        "skipped-and-cached",
        "slid-forks",
        "first-sharer-shorter",
        "second-sharer-shorter",
    ],
)
def test_sound_states_at_the_edges_of_the_rules_break_no_invariant(state: AllocatorState) -> None:
    assert violated_invariants(state) == []
