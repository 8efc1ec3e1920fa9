"""spec's prefix queries called directly, as a user fuzzing their own allocator does: their
default group, and a state built by hand without per-group host caches."""

from dataclasses import replace

import spec
from spec import HostTier, cached_prefix_blocks, cached_prefix_tokens, growth
from spec.api import OPERATIONS
from spec.caching import host_prefix_hits

PROMPT = (1, 2, 3, 4, 9)


def _one_group_with_a_cached_prefix() -> spec.AllocatorState:
    """Block size 2; "a" holds blocks 0 (1..2, cached), 1 (1..4, cached) and 2."""
    state, _ = OPERATIONS["allocate"].transition(spec.init(4, 2), "a", PROMPT)
    return state


def test_the_prefix_queries_answer_for_group_0_unless_told_otherwise() -> None:
    state = _one_group_with_a_cached_prefix()
    assert cached_prefix_tokens(state, PROMPT) == 4
    assert cached_prefix_blocks(state, PROMPT) == (0, 1)
    assert host_prefix_hits(state, PROMPT) == ()


def test_a_state_built_without_host_caches_has_no_host_hits() -> None:
    state = replace(_one_group_with_a_cached_prefix(), host=HostTier())
    assert state.host.host_caches == ()
    assert cached_prefix_blocks(state, PROMPT) == (0, 1)
    assert host_prefix_hits(state, PROMPT) == ()


def test_an_append_gives_every_groups_table_and_the_new_tokens_slots() -> None:
    state, _ = OPERATIONS["allocate"].transition(spec.init(4, 2, (None, 2)), "a", 2)
    state, appended = OPERATIONS["append"].transition(state, "a", 1)
    assert appended.table() == spec.RequestBlockTable("a", (0, 2), 3)
    assert appended.table(1) == spec.RequestBlockTable("a", (1, 3), 3)
    assert appended.slots == ((4,), (6,))
    assert OPERATIONS["tables"].transition(state, "a")[1] == (appended.table(), appended.table(1))


def test_a_pool_has_no_host_tier_unless_asked() -> None:
    host = spec.init(4, 2).host
    assert (host.host_blocks, host.host_prefix_cache, host.free_host_block_ids) == (0, False, ())


def test_a_hit_can_be_one_block_of_one_token() -> None:
    state, _ = OPERATIONS["allocate"].transition(spec.init(4, 1), "a", (5, 6))
    assert cached_prefix_tokens(state, (5, 9)) == 1


def test_a_release_forgets_the_requests_token_ids_and_salt() -> None:
    state, _ = OPERATIONS["allocate"].transition(spec.init(4, 2), "a", PROMPT, "s")
    assert ("a" in state.token_ids, "a" in state.cache_salts) == (True, True)
    state, _ = OPERATIONS["release"].transition(state, "a")
    assert ("a" in state.token_ids, "a" in state.cache_salts) == (False, False)


def test_the_spec_append_adds_one_token_by_default() -> None:
    state = growth.allocate(spec.init(4, 4), "a", 3)
    assert spec.snapshot_request(growth.append(state, "a"), "a").token_count == 4
