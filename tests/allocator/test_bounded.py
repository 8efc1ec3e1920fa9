"""The bounded model checker: a CI-sized exhaustive run, and every planted bug found by it."""

import dataclasses

import pytest

import spec
from impl import KVCacheManager
from spec import AllocatorState, FrozenMap
from spec.api import OPERATIONS, Step
from tests.support import bounded
from tests.support.bounded import (
    Bounds,
    Operation,
    all_bounds,
    all_host_bounds,
    all_salt_bounds,
    all_sharing_bounds,
    all_window_bounds,
    check,
    operations,
)
from tests.support.planted_bugs import (
    HOST_TIER_BUGS,
    PLANTED_BUGS,
    WINDOW_PLANTED_BUGS,
    DecodeSlotFromStaleBlock,
    EvictedBlockStaysFindable,
    EvictsWithoutRemoval,
    FreesSkippedBlocksButKeepsThem,
    IgnoresTheSaltOnLookup,
    LeaksAHostBlockOnSwapIn,
    LeaksOneBlockOnRelease,
    NeverSkips,
    OffByOneAtBlockBoundary,
    RefusedAllocateTakesBlocks,
    ReleasesInTableOrder,
    ResetKeepsTheKeysOfHeldBlocks,
    ResetRemovesEachBlock,
    ReusesABlockBeforeItsCopyOut,
    ReviveDropsTheSalt,
    RevivesADemotedPrefixUnsalted,
    SaltsOnlyTheFirstBlock,
    SkipsABlockOneStepEarly,
    SkipsCopyOnWrite,
    SkipsSharedDecrement,
    StoresARefusedKey,
    SwapInForgetsTheOtherHolder,
    TruncateKeepsTheCutBlocks,
    TruncateUnsharesTheLastBlock,
    TrustsHashOnWeakHash,
    WriteKeepsAKeptKey,
)

# The fast configuration: pools of 1..3 blocks of 1..3 tokens, three request ids, token
# counts -1 to one past capacity: 3,768 states, 418,452 transitions, 54 s on one core at 4126826.
FAST = list(all_bounds(max_blocks=3, max_block_size=3, request_ids=3, max_token_count=None))
# The sharing operations on pools of 1..2 blocks (only the 1- and 2-token shapes of
# 2 blocks: the 2 x 2 pool alone has 11,322 states and took 140 s on one core at 4126826).
FAST_SHARING = list(all_sharing_bounds(max_blocks=2, max_block_size=2, request_ids=2))[:3]
# Two tenants (no salt and "a") over the sharing operations (tests.support.bounded.SALT_SHAPES).
SALTS = list(all_salt_bounds())

# Each planted bug's first violation: the walk that finds it, the smallest pool shape
# (blocks, block_size) that shows it and the shortest path from init. Breadth first, so
# none shorter exists.
SHORTEST_FAILURES: dict[type[KVCacheManager], tuple[str, int, int, list[str]]] = {
    ReleasesInTableOrder: ("count", 2, 1, ["allocate('r0', 2)", "release('r0')"]),
    LeaksOneBlockOnRelease: ("count", 1, 1, ["allocate('r0', 1)", "release('r0')"]),
    RefusedAllocateTakesBlocks: ("count", 1, 1, ["allocate('r0', 2)"]),
    OffByOneAtBlockBoundary: ("count", 1, 1, ["allocate('r0', 0)"]),
    DecodeSlotFromStaleBlock: ("count", 2, 1, ["allocate('r0', 1)", "append('r0', 1)"]),
    TrustsHashOnWeakHash: ("sharing", 2, 1, ["allocate('r0', (0, 0))"]),
    SkipsSharedDecrement: (
        "sharing",
        1,
        1,
        ["allocate('r0', 1)", "fork('r0', 'r1')", "release('r0')"],
    ),
    SkipsCopyOnWrite: (
        "sharing",
        1,
        2,
        ["allocate('r0', 1)", "fork('r0', 'r1')", "append('r0', 1)"],
    ),
    EvictedBlockStaysFindable: (
        "sharing",
        1,
        1,
        ["allocate('r0', (0,))", "truncate('r0', 0)", "allocate('r1', 1)"],
    ),
    # Its report of the rollback names no stale slots for the group: wrong from the start.
    TruncateKeepsTheCutBlocks: ("count", 1, 1, ["allocate('r0', 0)", "truncate('r0', 0)"]),
    # Block 0 is held and cached; the reset must uncache it.
    ResetKeepsTheKeysOfHeldBlocks: (
        "sharing",
        1,
        1,
        ["allocate('r0', (0,))", "reset_prefix_cache()"],
    ),
    WriteKeepsAKeptKey: (
        "sharing",
        1,
        2,
        ["allocate('r0', (0, 0))", "truncate('r0', 1)", "append('r0', (1,))"],
    ),
    TruncateUnsharesTheLastBlock: (
        "sharing",
        1,
        2,
        [
            "allocate('r0', 1)",
            "append('r0', 1)",
            "fork('r0', 'r1')",
            "truncate('r0', 1)",
            "append('r0', 1)",
        ],
    ),
    # An unsalted block 0 is hit by tenant "a": it needs one block, not two.
    IgnoresTheSaltOnLookup: (
        "salts",
        1,
        1,
        ["allocate('r0', (0,))", "allocate('r1', (0, 1), 'a')"],
    ),
    # Block 1 of tenant "a"'s chain is cached under no salt.
    SaltsOnlyTheFirstBlock: ("salts", 2, 1, ["allocate('r0', (0, 1), 'a')"]),
    # The revived block 0 is re-cached under no salt.
    ReviveDropsTheSalt: (
        "salts",
        2,
        1,
        [
            "allocate('r0', (0, 1), 'a')",
            "release('r0')",
            "allocate('r0', (0, 1), 'a')",
        ],
    ),
    # Block 0, cached free after the rollback, is evicted for r1 with no BlockRemoved.
    EvictsWithoutRemoval: (
        "sharing",
        1,
        1,
        ["allocate('r0', (0,))", "truncate('r0', 0)", "allocate('r1', 1)"],
    ),
    # Block 0 caches (0,) already: r1's block 1 is refused that key, but reported stored.
    StoresARefusedKey: (
        "sharing",
        2,
        1,
        ["allocate('r0', (0,))", "allocate('r1', (0,))"],
    ),
    # A reset of empty caches still emits its one AllBlocksCleared.
    ResetRemovesEachBlock: ("sharing", 1, 1, ["reset_prefix_cache()"]),
}
WALKS = {"count": FAST, "sharing": FAST_SHARING, "salts": SALTS}
# KV cache groups with sliding windows: 4 count-based and 3 sharing shapes, one request id
# (see tests.support.bounded.WINDOW_COUNT_SHAPES). About 65 s under a load of 10 on the
# 2-core VM, so well under 30 s on an idle CI machine.
WINDOWS = list(all_window_bounds())

# Each window bug's first violation in the window walk: the shape (blocks, block_size,
# group_windows) and the shortest path from init.
WINDOW_SHORTEST_FAILURES: dict[
    type[KVCacheManager], tuple[int, int, tuple[int | None, ...], list[str]]
] = {
    # At L0 = 0 it skips a block of the empty table it allocates: skipped_blocks 1.
    SkipsABlockOneStepEarly: (3, 1, (1,), ["allocate('r0', 0)"]),
    # A window of 1 at L0 = 1: block index 0 is out, and stays.
    NeverSkips: (3, 1, (1,), ["allocate('r0', 1)", "append('r0', 0)"]),
    # The same block freed, but still in the table: a hole read.
    FreesSkippedBlocksButKeepsThem: (3, 1, (1,), ["allocate('r0', 1)", "append('r0', 0)"]),
}


# The host-tier walk: a 2-block host tier on pools of 1 and 2 blocks with two request ids,
# count-based operations, forks and swaps, then the sharing operations on 1 block, then
# the host prefix cache on 2 blocks (tests.support.bounded.HOST_COUNT_SHAPES). About 60 s
# under a load of 4 on the 2-core VM.
HOST = list(all_host_bounds())

# Each host-tier bug's first violation in the host walk: the pool shape (blocks,
# block_size) and the shortest path from init.
HOST_SHORTEST_FAILURES: dict[type[KVCacheManager], tuple[int, int, list[str]]] = {
    # The host block swap-in read never returns: the host tier is one short.
    LeaksAHostBlockOnSwapIn: (
        1,
        1,
        [
            "allocate('r0', 1)",
            "swap_out('r0')",
            "take_transfers()",
            "swap_in('r0')",
            "take_transfers()",
        ],
    ),
    # Block 0 goes straight to the free queue while its copy out is pending.
    ReusesABlockBeforeItsCopyOut: (1, 1, ["allocate('r0', 1)", "swap_out('r0')"]),
    # r0 gets back block 0, which r1 still holds, without a reference.
    SwapInForgetsTheOtherHolder: (
        2,
        1,
        ["allocate('r0', 1)", "fork('r0', 'r1')", "swap_out('r0')", "swap_in('r0')"],
    ),
    # Block 0's key ("a", (0,)) is demoted, evicted by r0's own count allocation and
    # revived from the host: impl re-caches it unsalted.
    RevivesADemotedPrefixUnsalted: (
        2,
        1,
        [
            "allocate('r0', (0,), 'a')",
            "release('r0')",
            "allocate('r0', 1)",
            "take_transfers()",
            "append('r0', 1)",
            "release('r0')",
            "allocate('r0', (0, 1), 'a')",
        ],
    ),
}


def first_violation(
    target_class: type[KVCacheManager], walk: list[Bounds]
) -> bounded.Violation | None:
    for bounds_ in walk:
        violation = check(bounds_, target_class).violation
        if violation is not None:
            return violation
    return None


def test_every_reachable_state_of_the_small_pools_agrees_between_spec_and_impl() -> None:
    reports = [check(bounds_) for bounds_ in FAST]
    print("\n".join(str(report) for report in reports))
    assert [report.violation for report in reports] == [None] * len(FAST)
    # Reachability is part of the spec's behaviour: these counts move only if it changes.
    assert [report.states for report in reports] == [20, 32, 44, 76, 160, 268, 378, 960, 1830]
    assert sum(report.transitions for report in reports) == 418_452


def test_every_reachable_sharing_state_of_the_small_pools_agrees_between_spec_and_impl() -> None:
    reports = [check(bounds_) for bounds_ in FAST_SHARING]
    print("\n".join(str(report) for report in reports))
    assert [report.violation for report in reports] == [None] * len(FAST_SHARING)
    assert [report.states for report in reports] == [62, 175, 992]
    assert sum(report.transitions for report in reports) == 74_440


def test_every_reachable_salted_state_of_the_small_pools_agrees_between_spec_and_impl() -> None:
    reports = [check(bounds_) for bounds_ in SALTS]
    print("\n".join(str(report) for report in reports))
    assert [report.violation for report in reports] == [None] * len(SALTS)
    assert [report.states for report in reports] == [161, 548]
    assert sum(report.transitions for report in reports) == 34_930


def test_every_reachable_windowed_state_of_the_small_pools_agrees_between_spec_and_impl() -> None:
    reports = [check(bounds_) for bounds_ in WINDOWS]
    print("\n".join(str(report) for report in reports))
    assert [report.violation for report in reports] == [None] * len(WINDOWS)
    assert [report.states for report in reports] == [426, 192, 192, 192, 456, 190, 1226]
    assert sum(report.transitions for report in reports) == 86_272


def test_every_reachable_host_tier_state_of_the_small_pools_agrees_between_spec_and_impl() -> None:
    reports = [check(bounds_) for bounds_ in HOST]
    print("\n".join(str(report) for report in reports))
    assert [report.violation for report in reports] == [None] * len(HOST)
    assert [report.states for report in reports] == [122, 984, 950, 1496]
    assert sum(report.transitions for report in reports) == 155_840


@pytest.mark.parametrize("broken", HOST_TIER_BUGS, ids=lambda cls: cls.__name__)
def test_the_host_walk_finds_each_planted_host_tier_bug_along_a_shortest_path(
    broken: type[KVCacheManager],
) -> None:
    violation = first_violation(broken, HOST)
    assert violation is not None, f"{broken.__name__} passed the bounded checker"
    shape = (violation.bounds.total_blocks, violation.bounds.block_size)
    assert (*shape, [str(op) for op in violation.path]) == HOST_SHORTEST_FAILURES[broken]


def test_every_planted_bug_has_a_listed_shortest_failure() -> None:
    assert set(SHORTEST_FAILURES) == set(PLANTED_BUGS)
    assert set(WINDOW_SHORTEST_FAILURES) == set(WINDOW_PLANTED_BUGS)
    assert set(HOST_SHORTEST_FAILURES) == set(HOST_TIER_BUGS)


@pytest.mark.parametrize("broken", WINDOW_PLANTED_BUGS, ids=lambda cls: cls.__name__)
def test_the_window_walk_finds_each_planted_window_bug_along_a_shortest_path(
    broken: type[KVCacheManager],
) -> None:
    violation = first_violation(broken, WINDOWS)
    assert violation is not None, f"{broken.__name__} passed the bounded checker"
    bounds_ = violation.bounds
    found = (bounds_.total_blocks, bounds_.block_size, bounds_.group_windows)
    assert (*found, [str(op) for op in violation.path]) == WINDOW_SHORTEST_FAILURES[broken]


def test_a_spec_step_that_keeps_a_block_outside_its_window_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def append_without_skipping(
        state: AllocatorState, request_id: str, tokens: int
    ) -> tuple[AllocatorState, object]:
        # The spec's own append, on the pool as if its window were full attention.
        full = dataclasses.replace(
            state, group_windows=(spec.FullAttention(),) * len(state.group_windows)
        )
        after, appended = OPERATIONS["append"].transition(full, request_id, tokens)
        return dataclasses.replace(after, group_windows=state.group_windows), appended

    _patch_spec_step(monkeypatch, "append", append_without_skipping)
    violation = check(WINDOWS[0]).violation
    assert violation is not None
    assert [str(op) for op in violation.path] == ["allocate('r0', 1)", "append('r0', 0)"]
    assert violation.reason == "spec left a block wholly outside its window in a table"


@pytest.mark.parametrize("broken", PLANTED_BUGS, ids=lambda cls: cls.__name__)
def test_the_checker_finds_each_planted_bug_along_a_shortest_path(
    broken: type[KVCacheManager],
) -> None:
    walk, *expected = SHORTEST_FAILURES[broken]
    violation = first_violation(broken, WALKS[walk])
    assert violation is not None, f"{broken.__name__} passed the bounded checker"
    shape = (violation.bounds.total_blocks, violation.bounds.block_size)
    assert [*shape, [str(op) for op in violation.path]] == expected


def test_the_checker_tries_every_row_with_negative_counts_unknown_ids_and_exhaustion() -> None:
    ops = [str(op) for op in operations(Bounds(1, 1, ("r0",), 2))]
    assert ops == [
        "allocate('r0', -1)",
        "allocate('r0', 0)",
        "allocate('r0', 1)",
        "allocate('r0', 2)",  # more than the pool holds
        "allocate('r0', None)",  # no count at all
        "append('r0', -1)",
        "append('r0', 0)",
        "append('r0', 1)",
        "append('r0', 2)",
        "append('r0', None)",
        "truncate('r0', -1)",
        "truncate('r0', 0)",
        "truncate('r0', 1)",
        "truncate('r0', 2)",
        "truncate('r0', None)",
        "release('r0')",
        "preempt('r0')",
        "take_transfers()",
        "reset_prefix_cache()",
        "tables('r0')",
        "cache_view()",
        "usage()",
    ]


def test_the_walks_try_forks_with_prompts_or_a_host_tier_and_swaps_with_a_host_tier() -> None:
    assert "fork" not in bounded.rows(Bounds(1, 1, ("r0",), 1))
    assert "fork" in bounded.rows(Bounds(1, 1, ("r0",), 1, prompts=((0,),)))
    assert {"fork", "swap_out", "swap_in"} <= set(
        bounded.rows(Bounds(1, 1, ("r0",), 1, host_blocks=1))
    )
    assert set(bounded.rows(HOST[-1])) == set(OPERATIONS)


def test_a_spec_step_that_breaks_an_invariant_is_reported_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def release_forgetting_the_blocks(
        state: AllocatorState, request_id: str
    ) -> tuple[AllocatorState, object]:
        released = spec.ReleasedBlocks(spec.snapshot_request(state, request_id).block_ids, (), ())
        tables = (state.tables.delete(request_id),)
        return dataclasses.replace(state, group_tables=tables), released

    _patch_spec_step(monkeypatch, "release", release_forgetting_the_blocks)
    violation = check(Bounds(1, 1, ("r0",), 2)).violation
    assert violation is not None
    assert [str(op) for op in violation.path] == ["allocate('r0', 1)", "release('r0')"]
    assert violation.reason == "spec breaks invariant(s) conservation, partition, ref_counts"


def test_the_command_line_prints_states_and_transitions_per_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bounded.main(["--max-blocks", "2", "--max-block-size", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "blocks=1 block_size=1 request_ids=3 token_counts=-1..2: 20 states, 1160 transitions"
    )
    assert lines[1].startswith("blocks=2 block_size=1 request_ids=3 token_counts=-1..3: 76 states")
    assert lines[2].startswith("all configurations: 96 states, 6252 transitions")


def test_the_command_line_exits_one_and_prints_the_path_on_a_planted_bug(
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = "tests.support.planted_bugs:LeaksOneBlockOnRelease"
    assert bounded.main(["--target", target, "--max-blocks", "1", "--max-block-size", "1"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION in LeaksOneBlockOnRelease" in out
    assert "  1. allocate('r0', 1)\n  2. release('r0')" in out


def test_the_command_line_refuses_a_target_that_is_not_an_allocator() -> None:
    with pytest.raises(ValueError, match="is not a KVCacheManager class"):
        bounded.main(["--target", "spec:AllocatorState"])


def test_a_spec_step_that_touches_another_requests_table_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def release_dropping_every_table(
        state: AllocatorState, request_id: str
    ) -> tuple[AllocatorState, object]:
        held = spec.snapshot_request(state, request_id).block_ids
        released = spec.ReleasedBlocks(held, tuple(reversed(held)), ())
        freed = state.free_block_ids + tuple(
            block_id for table in state.tables.values() for block_id in reversed(table.block_ids)
        )
        dropped = dataclasses.replace(
            state, free_block_ids=freed, group_tables=(FrozenMap(),), ref_counts=FrozenMap()
        )
        return dropped, released

    _patch_spec_step(monkeypatch, "release", release_dropping_every_table)
    violation = check(Bounds(2, 1, ("r0", "r1"), 2)).violation
    assert violation is not None
    assert violation.reason == "spec changed the table of a request it was not asked about"
    assert [str(op) for op in violation.path] == [
        "allocate('r0', 0)",
        "allocate('r1', 0)",
        "release('r0')",
    ]


def test_a_spec_step_that_raises_an_unspecified_error_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def tables_with_an_index_error(
        state: AllocatorState, request_id: str
    ) -> tuple[AllocatorState, object]:
        raise IndexError("tuple index out of range")

    _patch_spec_step(monkeypatch, "tables", tables_with_an_index_error)
    violation = check(Bounds(1, 1, ("r0",), 2)).violation
    assert violation is not None
    assert violation.path == (Operation("tables", ("r0",)),)
    assert violation.reason == "spec raised an unspecified IndexError(tuple index out of range)"


def test_a_spec_step_whose_events_do_not_replay_to_its_caches_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def append_without_its_removals(
        state: AllocatorState, request_id: str, tokens: object
    ) -> tuple[AllocatorState, object]:
        after, slots = OPERATIONS["append"].transition(state, request_id, tokens)
        kept = tuple(e for e in after.events if not isinstance(e, spec.BlockRemoved))
        return dataclasses.replace(after, events=kept), slots

    _patch_spec_step(monkeypatch, "append", append_without_its_removals)
    violation = check(FAST_SHARING[1]).violation
    assert violation is not None
    # The block the first allocation cached, evicted by the append, whose removal is gone.
    assert [str(op) for op in violation.path] == [
        "allocate('r0', (0, 0))",
        "truncate('r0', 0)",
        "append('r0', (0, 0))",
    ]
    assert violation.reason.startswith("spec's events [BlockStored(block_id=0, ")
    assert violation.reason.endswith("which the view holds a key for already")


def _patch_spec_step(monkeypatch: pytest.MonkeyPatch, name: str, step: Step) -> None:
    """Replace the transition of one row of the table the bounded checker drives spec with."""
    row = dataclasses.replace(OPERATIONS[name], transition=step)
    monkeypatch.setattr(bounded, "OPERATIONS", {**OPERATIONS, name: row})
