"""The state group's named invariants (``spec.invariants``), each broken by a state built
from a sound one, and the state hit rule of an admission (``is_state_hit_exact``)."""

from dataclasses import replace

import pytest

import spec
from spec import AllocatorState, CacheKey, FrozenMap, RequestBlockTable
from spec.api import OPERATIONS
from spec.invariants import (
    is_cached_content_exact,
    is_checkpoint_on_grid,
    is_checkpoint_unwritten,
    is_shared_only_over_a_common_prefix,
    is_state_hit_exact,
    is_state_shared_only_by_forks,
    is_tightly_sized,
)

PROMPT = tuple(range(1, 9))


def hybrid(interval: int = 4) -> AllocatorState:
    """Blocks of 4: a full group and a state group; request a at 8 tokens, its state
    checkpointed at 4 in block 1 (cached free), its running state in block 3, the copy
    between them taken."""
    state = spec.init(10, 4, (None, spec.RecurrentState(interval)))
    state, _ = OPERATIONS["allocate"].transition(state, "a", PROMPT[:4])
    state, _ = OPERATIONS["append"].transition(state, "a", PROMPT[4:])
    state, _ = OPERATIONS["take_transfers"].transition(state)
    return spec.take_events(state)


def with_state_table(state: AllocatorState, table: RequestBlockTable) -> AllocatorState:
    tables = state.group_tables[1].set(table.request_id, table)
    return replace(state, group_tables=(state.group_tables[0], tables))


def test_the_hybrid_state_is_sound() -> None:
    state = hybrid()
    assert spec.violated_invariants(state) == []
    assert state.group_tables[1]["a"].block_ids == (3,)
    assert state.group_caches[1] == FrozenMap({CacheKey(None, PROMPT[:4]): 1})


def test_a_state_table_of_two_blocks_breaks_tight_sizing() -> None:
    state = hybrid()
    broken = with_state_table(state, RequestBlockTable("a", (3, 4), 8))
    assert "tight_sizing" in spec.violated_invariants(broken)


def test_a_state_table_of_no_block_breaks_tight_sizing_and_no_rule_raises() -> None:
    broken = with_state_table(hybrid(), RequestBlockTable("a", (), 8))
    assert "tight_sizing" in spec.violated_invariants(broken)
    assert is_checkpoint_unwritten(broken)  # it holds no checkpoint


def test_a_table_past_its_checkpoint_still_holding_it_breaks_checkpoint_unwritten() -> None:
    # a at 8 tokens runs in the block cached as the state after 4: it would write it.
    state = hybrid()
    broken = with_state_table(state, RequestBlockTable("a", (1,), 8))
    broken = replace(
        broken,
        cached_free_block_ids=(),
        free_block_ids=(*broken.free_block_ids, 3),
        ref_counts=broken.ref_counts.delete(3).set(1, 1),
    )
    assert spec.violated_invariants(broken) == ["checkpoint_unwritten"]


def test_checkpoint_unwritten_looks_past_a_table_holding_no_checkpoint() -> None:
    state = spec.init(10, 4, (None, spec.RecurrentState(4)))
    state, _ = OPERATIONS["allocate"].transition(state, "b", 2)  # by count: block 1
    state, _ = OPERATIONS["allocate"].transition(state, "a", PROMPT[:4])
    state, _ = OPERATIONS["append"].transition(state, "a", PROMPT[4:])  # checkpoint: 3
    assert is_checkpoint_unwritten(state)
    # a at 8 tokens running in block 3, the state after 4: its tokens are not the key's.
    assert not is_checkpoint_unwritten(with_state_table(state, RequestBlockTable("a", (3,), 8)))


def test_a_checkpoint_off_the_interval_grid_breaks_checkpoint_on_grid() -> None:
    # The same checkpoint at 4 tokens, in a group checkpointed every 8.
    broken = replace(hybrid(), group_windows=(spec.FullAttention(), spec.RecurrentState(8)))
    assert spec.violated_invariants(broken) == ["checkpoint_on_grid"]


def test_a_checkpoint_is_on_the_grid_from_one_interval_on_never_at_no_tokens() -> None:
    state = spec.init(4, 1, (None, spec.RecurrentState(1)))

    def caching(key: CacheKey) -> AllocatorState:
        return replace(state, group_caches=(state.group_caches[0], FrozenMap({key: 2})))

    assert is_checkpoint_on_grid(caching(CacheKey(None, (7,))))  # after 1 token
    assert not is_checkpoint_on_grid(caching(CacheKey(None, ())))


def test_two_requests_of_other_lengths_sharing_a_state_break_state_shared_only_by_forks() -> None:
    state = spec.init(10, 4, (None, spec.RecurrentState(4)))
    state, _ = OPERATIONS["allocate"].transition(state, "a", 3)
    state, _ = OPERATIONS["allocate"].transition(state, "b", 5)
    (b_state,) = state.group_tables[1]["b"].block_ids
    broken = with_state_table(state, RequestBlockTable("b", (1,), 5))
    broken = replace(
        broken,
        free_block_ids=(b_state, *broken.free_block_ids),
        ref_counts=broken.ref_counts.delete(b_state).set(1, 2),
    )
    assert spec.violated_invariants(broken) == ["state_shared_only_by_forks"]


def test_a_state_shared_at_one_length_breaks_the_rule_only_over_other_token_ids() -> None:
    state = spec.init(10, 4, (None, spec.RecurrentState(4)))
    state, _ = OPERATIONS["allocate"].transition(state, "c", 2)  # another state: block 1
    state, _ = OPERATIONS["allocate"].transition(state, "a", (1, 2, 3))  # block 3
    state, _ = OPERATIONS["fork"].transition(state, "a", "b")  # b shares block 3
    assert is_state_shared_only_by_forks(state)  # the same ids
    other_ids = replace(state, token_ids=state.token_ids.set("b", (1, 2, 4)))
    assert not is_state_shared_only_by_forks(other_ids)
    # One side tracked by count: no ids to compare, as for a fork of a count request.
    assert is_state_shared_only_by_forks(replace(state, token_ids=state.token_ids.delete("b")))
    other_length = with_state_table(state, RequestBlockTable("b", (3,), 4))
    assert not is_state_shared_only_by_forks(other_length)  # past the first pair too


def test_an_admission_is_state_hit_exact_only_with_the_copy_of_its_own_checkpoint() -> None:
    before = hybrid()
    after, slots = OPERATIONS["allocate"].transition(before, "b", (*PROMPT, 9))
    assert slots.cached_tokens == 4
    assert is_state_hit_exact(before, after, "b", 4)
    assert not is_state_hit_exact(before, after, "b", 0)  # a copy where no hit is
    (b_state,) = after.group_tables[1]["b"].block_ids
    earlier = replace(after, pending_copies=((3, b_state),))  # a's running state, not the key's
    assert not is_state_hit_exact(before, earlier, "b", 4)
    # A hit past every checkpoint, with the copy of an earlier one (block 1, at 4) or with
    # none: the block holds no state of h tokens.
    assert not is_state_hit_exact(before, after, "b", 8)
    assert not is_state_hit_exact(before, replace(after, pending_copies=()), "b", 8)


def test_a_miss_is_state_hit_exact_only_with_no_copy_into_any_state_group() -> None:
    before = spec.init(12, 4, (None, spec.RecurrentState(4), spec.RecurrentState(4)))
    after, slots = OPERATIONS["allocate"].transition(before, "a", PROMPT[:3])
    assert slots.cached_tokens == 0 and is_state_hit_exact(before, after, "a", 0)
    (second_state,) = after.group_tables[2]["a"].block_ids
    copied = replace(
        after, pending_copies=((after.group_tables[1]["a"].block_ids[0], second_state),)
    )
    assert not is_state_hit_exact(before, copied, "a", 0)


def test_the_state_rules_refuse_to_pair_lists_of_other_lengths() -> None:
    """A hand-built state missing the state group's table: each rule that walks the state
    groups pairs kinds, tables and caches, and raises rather than skip the group."""
    state = spec.init(10, 4, (None, spec.RecurrentState(8)))
    one_table = replace(state, group_tables=state.group_tables[:1])
    rules = (
        is_tightly_sized,
        is_checkpoint_unwritten,
        is_checkpoint_on_grid,
        is_state_shared_only_by_forks,
    )
    for rule in rules:
        with pytest.raises(ValueError, match="zip"):
            rule(one_table)


def test_the_attention_rules_walk_the_groups_after_a_state_group() -> None:
    """A state group listed before an attention group (the spec takes the groups in any
    order): the content and sharing rules skip it and still judge the group after it."""
    state = spec.init(10, 4, (spec.RecurrentState(4), None))
    state, _ = OPERATIONS["allocate"].transition(state, "a", PROMPT)
    assert spec.violated_invariants(state) == []
    first_block = state.group_caches[1][CacheKey(None, PROMPT[:4])]
    inexact = replace(
        state,
        group_caches=(
            state.group_caches[0],
            FrozenMap({CacheKey(None, (9, 9, 9, 9)): first_block}),
        ),
    )
    assert not is_cached_content_exact(inexact)
    second_block = state.group_tables[1]["a"].block_ids[1]
    shifted = replace(
        state,
        group_tables=(
            state.group_tables[0],
            state.group_tables[1].set("b", RequestBlockTable("b", (second_block,), 4)),
        ),
    )
    assert not is_shared_only_over_a_common_prefix(shifted)  # a's index 1 is b's index 0


def test_the_sharing_rule_leaves_a_state_group_to_its_own_rule() -> None:
    """Two requests of other token ids sharing a state block (as no fork would): the state
    rule says so, the attention groups' sharing rule does not judge the state group."""
    state = spec.init(10, 4, (None, spec.RecurrentState(4)))
    state, _ = OPERATIONS["allocate"].transition(state, "a", (1, 2, 3))
    state, _ = OPERATIONS["allocate"].transition(state, "b", (1, 2, 4))
    (a_state,) = state.group_tables[1]["a"].block_ids
    shared = with_state_table(state, RequestBlockTable("b", (a_state,), 3))
    assert not is_state_shared_only_by_forks(shared)
    assert is_shared_only_over_a_common_prefix(shared)


def test_a_state_table_that_skips_its_block_reads_a_hole() -> None:
    # Blocks of 1 token: one skipped block is position 0 alone, which a state group reads
    # from (its first_read is 0), so even that one is a hole.
    state = spec.init(6, 1, (None, spec.RecurrentState(1)))
    state, _ = OPERATIONS["allocate"].transition(state, "a", (1, 2))
    assert spec.violated_invariants(state) == []
    table = state.group_tables[1]["a"]
    broken = with_state_table(state, replace(table, skipped_blocks=1))
    assert "window_readable" in spec.violated_invariants(broken)
