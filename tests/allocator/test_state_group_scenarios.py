"""Scenarios of a recurrent state group (``spec.kinds``) with literal block ids, each run on
spec and impl alike (``docs/design.md``, "Recurrent state groups")."""

from collections.abc import Callable

import pytest

import spec
from impl import KVBlockManager, KVCacheManager
from impl.spec_backed import SpecBackedManager

STATE = spec.RecurrentState(4)
PROMPT = tuple(range(1, 13))
Manager = Callable[..., KVCacheManager | SpecBackedManager]
BOTH = pytest.mark.parametrize("make", [KVCacheManager, SpecBackedManager], ids=["impl", "spec"])


def hybrid(make: Manager, total_blocks: int = 10) -> KVCacheManager | SpecBackedManager:
    """Blocks of 4 tokens; a full-attention group, then a state group checkpointed every 4."""
    return make(total_blocks, 4, group_windows=(None, STATE))


@BOTH
def test_a_checkpoint_is_cached_at_the_next_append_and_a_sharer_restores_it(
    make: Manager,
) -> None:
    pool = hybrid(make)
    first = pool.allocate("a", PROMPT[:4])
    assert first.block_ids == ((0,), (1,))
    assert first.slots == ((0, 1, 2, 3), ())  # a state group has no per-token slot
    # L0 = 4 is on the grid: block 1 is cached as the state after PROMPT[:4] and copied.
    grown = pool.append("a", PROMPT[4:8])
    assert grown.block_ids == ((0, 2), (3,))
    assert pool.take_transfers().copies == ((1, 3),)
    assert pool.to_spec().cached_free_block_ids == (1,)
    # No checkpoint at 8 yet (a has not appended past it): the common hit is 4, not the 8
    # full attention alone would give (vllm #45238's penalty).
    assert pool.cached_prefix_tokens((*PROMPT[:8], 90, 91)) == 4
    shared = pool.allocate("b", (*PROMPT[:8], 90, 91))
    assert shared.cached_tokens == 4
    assert shared.block_ids == ((0, 4, 5), (6,))
    assert pool.take_transfers().copies == ((1, 6),)
    assert pool.to_spec().cached_free_block_ids == (1,)


@BOTH
def test_an_append_of_no_tokens_at_a_checkpoint_caches_nothing(make: Manager) -> None:
    """The state after PROMPT[:4] is cached when a token goes past it, not on an empty
    append: block 1 stays the running state, held alone, and nothing is copied."""
    pool = hybrid(make)
    pool.allocate("a", PROMPT[:4])
    assert pool.append("a", ()).block_ids == ((0,), (1,))
    assert pool.take_transfers().copies == ()
    assert pool.to_spec().cached_free_block_ids == ()
    assert pool.cached_prefix_tokens(PROMPT[:8]) == 0


@BOTH
def test_preemption_recomputes_from_the_last_checkpoint_still_cached(make: Manager) -> None:
    pool = hybrid(make)
    pool.allocate("a", PROMPT[:4])
    pool.append("a", PROMPT[4:8])
    pool.append("a", PROMPT[8:9])  # L0 = 8: checkpointed
    pool.take_transfers()
    pool.preempt("a")
    assert pool.allocate("a", PROMPT[:10]).cached_tokens == 8


@BOTH
def test_truncate_below_the_length_is_refused_with_the_numbers_and_changes_nothing(
    make: Manager,
) -> None:
    pool = hybrid(make)
    pool.allocate("a", PROMPT[:6])
    before = pool.to_spec()
    with pytest.raises(ValueError) as refused:
        pool.truncate("a", 4)
    assert str(refused.value) == (
        "cannot truncate request 'a' from 6 to 4 tokens: state group 1 holds a recurrent "
        "state, which cannot be rewound"
    )
    assert pool.to_spec() == before
    assert pool.truncate("a", 6).block_ids == ()  # to its own length: nothing to drop
    assert pool.to_spec() == before


@BOTH
def test_fork_shares_the_state_and_each_side_copies_it_before_writing(make: Manager) -> None:
    pool = hybrid(make)
    pool.allocate("a", 3)
    assert pool.fork("a", "b")[1].block_ids == (1,)
    # Shared: b copies the partly filled attention block and the state.
    assert pool.append("b", 1).block_ids == ((2,), (3,))
    assert pool.append("a", 1).block_ids == ((0,), (1,))  # a alone now: in place
    assert pool.take_transfers().copies == ((0, 2), (1, 3))


@BOTH
def test_a_fork_at_a_checkpoint_copies_it_on_both_sides(make: Manager) -> None:
    pool = hybrid(make)
    pool.allocate("a", PROMPT[:4])
    pool.fork("a", "b")
    # a checkpoints block 1 and copies it; b still holds the checkpoint, so b copies too.
    assert pool.append("a", PROMPT[4:5]).block_ids[1] == (3,)
    assert pool.append("b", PROMPT[4:5]).block_ids[1] == (5,)
    assert pool.to_spec().cached_free_block_ids == (1,)
    assert spec.violated_invariants(pool.to_spec()) == []


@pytest.mark.parametrize(
    ("group_windows", "host_blocks", "error", "message"),
    [
        (
            (None, spec.RecurrentState(6)),
            0,
            ValueError,
            "interval of state group 1 must be a positive multiple of the block size 4, got 6",
        ),
        (
            (spec.RecurrentState(0),),
            0,
            ValueError,
            "interval of state group 0 must be a positive multiple of the block size 4, got 0",
        ),
        (
            (None, spec.RecurrentState(4.0)),  # type: ignore[arg-type]  # refused
            0,
            TypeError,
            "interval of state group 1 must be an int, got float 4.0",
        ),
        (
            (None, STATE),
            2,
            ValueError,
            "state group 1 cannot share a pool with a host tier yet: host_blocks must be 0, got 2",
        ),
    ],
)
@BOTH
def test_a_state_group_the_pool_cannot_serve_is_refused_in_one_line(
    make: Manager,
    group_windows: tuple[spec.GroupEntry, ...],
    host_blocks: int,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as refused:
        make(8, 4, group_windows=group_windows, host_blocks=host_blocks)
    assert str(refused.value) == message


def test_the_article_layer_counts_one_block_for_a_state_group() -> None:
    pool = KVBlockManager(3, 4, group_windows=(None, STATE))
    assert pool.can_allocate(8)  # 2 blocks of attention, 1 of state
    assert not pool.can_allocate(9)


@pytest.mark.parametrize(
    ("interval", "computed_tokens", "checkpointed"),
    [(1, 0, False), (1, 1, True), (4, 4, True), (4, 6, False), (4, 8, True)],
)
def test_a_checkpoint_is_due_at_each_positive_multiple_of_the_interval(
    interval: int, computed_tokens: int, checkpointed: bool
) -> None:
    assert spec.RecurrentState(interval).is_checkpoint_at(computed_tokens) is checkpointed


@BOTH
def test_an_append_of_no_tokens_copies_no_shared_state(make: Manager) -> None:
    """Nothing is written, so neither side of a fork copies its shared state (or the
    shared, partly filled attention block) yet."""
    pool = hybrid(make)
    pool.allocate("a", 3)
    pool.fork("a", "b")
    assert pool.append("b", 0).block_ids == ((0,), (1,))
    assert pool.take_transfers().copies == ()
    assert pool.usage().used_blocks == 2
