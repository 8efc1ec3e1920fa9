"""The spec-side model of a target: ids renamed through the bijection, block contents
learned from the tables, cached blocks turned into spec cache entries."""

import spec
from harness.conformance import Observation, TargetTable
from harness.conformance.view import Bijection, Contents, duplicate_cached_blocks, to_state


def test_the_bijection_maps_the_pool_in_ascending_order_and_strays_past_it() -> None:
    bijection = Bijection([13, 2, 7])
    assert bijection.spec_ids([2, 7, 13]) == (0, 1, 2)
    assert bijection.spec_id(99) == 3 and bijection.target_ids([3, 0]) == (99, 2)
    assert bijection.total_blocks == 3


def _observation(cached: frozenset[int]) -> Observation:
    return Observation(
        tables=({"a": TargetTable((12, 11), 6), "b": TargetTable((10,), 4)},),
        free_block_ids=(13,),
        cached_free_block_ids=(),
        cached_block_ids=(cached,),
        ref_counts={12: 1, 11: 1, 10: 1},
    )


def test_a_target_state_becomes_the_spec_state_it_is_in() -> None:
    observation = _observation(frozenset({12}))
    contents = Contents(groups=1)
    tokens = {"a": (1, 2, 3, 4, 5, 6), "b": (1, 2, 3, 4)}
    contents.learn(observation, tokens, block_size=4)
    state = to_state(
        observation,
        block_size=4,
        group_windows=(spec.FullAttention(),),
        bijection=Bijection(range(10, 14)),
        contents=contents,
        token_ids=tokens,
    )
    assert state.free_block_ids == (3,)
    assert state.tables["a"].block_ids == (2, 1) and state.tables["b"].block_ids == (0,)
    assert dict(state.cache) == {spec.CacheKey(None, (1, 2, 3, 4)): 2}
    assert spec.violated_invariants(state) == []
    # Block 10 holds the same prefix as block 12: a second block for a cached prefix.
    assert duplicate_cached_blocks(_observation(frozenset({10, 12})), contents) == [12]


def test_a_cached_block_whose_content_was_never_seen_breaks_cache_soundness() -> None:
    observation = _observation(frozenset({13}))
    state = to_state(
        observation,
        block_size=4,
        group_windows=(spec.FullAttention(),),
        bijection=Bijection(range(10, 14)),
        contents=Contents(groups=1),
        token_ids={},
    )
    assert "cache_sound" in spec.violated_invariants(state)
