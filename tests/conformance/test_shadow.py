"""The absolute properties' helpers: what a call may evict when the spec refuses it."""

import spec
from harness.conformance import Observation, TargetTable
from harness.conformance.shadow import eviction_findings, revived_counts

KEY_A = spec.CacheKey(None, (1, 2))
KEY_B = spec.CacheKey(None, (3, 4))


def _before() -> Observation:
    # blocks 1 and 2 are cached free (keys A and B), block 3 is free, request r0 holds 0
    return Observation(
        tables=({"r0": TargetTable((0,), 2)},),
        free_block_ids=(3,),
        cached_free_block_ids=(1, 2),
        cached_block_ids=(frozenset({1, 2}),),
    )


def test_a_call_the_spec_refuses_may_lose_the_keys_of_the_cached_blocks_it_took() -> None:
    after = Observation(
        tables=({"r0": TargetTable((0,), 2), "r1": TargetTable((1,), 2)},),
        free_block_ids=(3,),
        cached_free_block_ids=(2,),
        cached_block_ids=(frozenset({2}),),
    )
    allowed = revived_counts(_before(), after)
    assert allowed == [1.0]
    findings, lost = eviction_findings(
        [frozenset({KEY_A, KEY_B})], [frozenset({KEY_B})], allowed, 0
    )
    assert findings == [] and lost == [frozenset({KEY_A})]


def test_a_call_the_spec_refuses_may_not_drop_the_key_of_a_block_it_left_free() -> None:
    after = Observation(
        tables=({"r0": TargetTable((0,), 2), "r1": TargetTable((3,), 2)},),
        free_block_ids=(1,),
        cached_free_block_ids=(2,),
        cached_block_ids=(frozenset({2}),),
    )
    allowed = revived_counts(_before(), after)
    assert allowed == [0.0]
    findings, _ = eviction_findings([frozenset({KEY_A, KEY_B})], [frozenset({KEY_B})], allowed, 0)
    assert [finding.name for finding in findings] == ["eviction_justified"]
    assert findings[0].target == "1 key(s) left the cache: group 0: [1, 2]"
