"""The metamorphic relations (``tests/support/metamorphic.py``, and the stream consumers'
of ``tests/support/stream_consumers.py``) on spec and impl, each shown to catch the design
bug planted for it (``tests/support/planted_design_bugs.py``), and the counterexample the
salt relation leaves out, as a scenario."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from tests.support.metamorphic import (
    ForkReleaseLeavesTheCache,
    HostTierAddsHits,
    LargerPoolKeepsHits,
    PairMachine,
    ResetIsAFreshPool,
    SaltNeverRaisesHits,
    run_relation,
)
from tests.support.planted_design_bugs import (
    FlushesTheCacheWhenOutOfFreeBlocks,
    ForkCopiesTheLastBlockAtOnce,
    HoldsDemotedBlocksInFlight,
    ResetKeepsTheHostKeys,
    ResyncWithoutItsClear,
    RollbackUncachesASharedBlock,
)
from tests.support.stream_consumers import ConsumersMachine

TestAHostTierAddsHits = HostTierAddsHits.TestCase
TestALargerPoolKeepsHits = LargerPoolKeepsHits.TestCase
TestASaltNeverRaisesHits = SaltNeverRaisesHits.TestCase
TestAForkReleasedAtOnceLeavesTheCache = ForkReleaseLeavesTheCache.TestCase
TestAResetIsAFreshPool = ResetIsAFreshPool.TestCase
TestAConsumerOfTheStreamHoldsTheCachesKeys = ConsumersMachine.TestCase

# The ``ci`` profile without shrinking: a planted bug is caught by its first failing case.
CATCHING = settings(settings.get_profile("mutation"), max_examples=300)

PLANTED: list[tuple[type[PairMachine], type[KVCacheManager], str]] = [
    (HostTierAddsHits, HoldsDemotedBlocksInFlight, "the host tier changed the device side"),
    (LargerPoolKeepsHits, FlushesTheCacheWhenOutOfFreeBlocks, "in the smaller pool"),
    (SaltNeverRaisesHits, RollbackUncachesASharedBlock, "unsalted"),
    (ForkReleaseLeavesTheCache, ForkCopiesTheLastBlockAtOnce, "a fork released at once"),
    (ResetIsAFreshPool, ResetKeepsTheHostKeys, "after a reset"),
]


@pytest.mark.parametrize(
    ("relation", "planted", "message"), PLANTED, ids=[bug.__name__ for _, bug, _ in PLANTED]
)
def test_each_relation_catches_the_design_bug_planted_for_it(
    relation: type[PairMachine], planted: type[KVCacheManager], message: str
) -> None:
    run_relation(relation, KVCacheManager, CATCHING)  # holds on the real impl
    with pytest.raises(AssertionError, match=message):
        run_relation(relation, planted, CATCHING)


def test_a_consumer_that_resyncs_catches_a_resync_without_its_clear() -> None:
    planted = type("Planted", (ConsumersMachine,), {"publisher_class": ResyncWithoutItsClear})
    with pytest.raises(AssertionError, match="consumer"):
        run_state_machine_as_test(planted, settings=CATCHING)


@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_under_salts_a_duplicate_of_an_evicted_block_stays_cached(
    make: type[KVCacheManager],
) -> None:
    # The counterexample that ``SaltNeverRaisesHits`` leaves out (shrunk from a run of it):
    # unsalted, r1's block of token 2 duplicates r0's cached one, so it is not cached
    # (vLLM's rule too); r0's is evicted, and the prefix is cached nowhere though r1 holds
    # its K/V. Under salt "b", r1's block is the first of its prefix: it is cached.
    cached = []
    for salts in ({"r0": None, "r1": None}, {"r0": "a", "r1": "b"}):
        pool = make(7, 1)
        pool.allocate("r0", (2, 2, 2, 2, 2), salts["r0"])
        pool.release("r0")  # five cached free blocks: 2, 22, 222, 2222, 22222
        pool.allocate("r1", (0,), salts["r1"])
        pool.append("r1", (0, 0, 0, 0))  # evicts 22222, 2222 and 222
        pool.truncate("r1", 0)  # r1's five blocks cached free behind 22 and 2
        pool.append("r1", (2,))  # evicts 22; unsalted, a duplicate of r0's block of 2
        pool.append("r1", (0, 0, 0, 0, 0))  # evicts r0's block of 2 and r1's old blocks
        cached.append(pool.cached_prefix_tokens((2, 2), salts["r1"]))
    assert cached == [0, 1]


@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_under_salts_a_rewrite_after_a_rollback_leaves_the_shared_prefix_cached(
    make: type[KVCacheManager],
) -> None:
    # The other counterexample ``SaltNeverRaisesHits`` leaves out (shrunk from a run of it
    # in a fresh-clone CI): unsalted, r0's prompt hits r1's cached block 222, r0 alone
    # holds it, rolls back into it and writes there, which forgets its key; the one copy
    # of that prefix is gone. Under salts, r0 got a block of its own, and r1's stays cached.
    cached = []
    for salts in ({"r0": None, "r1": None}, {"r0": "a", "r1": "b"}):
        pool = make(3, 3)
        pool.allocate("r1", (2, 2, 2, 2, 2), salts["r1"])
        pool.release("r1")  # 222 cached free
        pool.allocate("r0", (2, 2, 2, 2, 2), salts["r0"])
        pool.truncate("r0", 2)
        pool.append("r0", (0,))
        cached.append(pool.cached_prefix_tokens((2, 2, 2, 2, 2), salts["r1"]))
    assert cached == [0, 3]
