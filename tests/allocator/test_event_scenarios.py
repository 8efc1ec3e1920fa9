"""KV cache events with literal block ids, on spec and impl alike: which operation emits
which event, in what order, and what a router replaying them sees."""

from collections.abc import Callable

import pytest

from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    CacheKey,
    EventReplayError,
    KVCacheEvent,
    replay_events,
)
from tests.support.reading import cached_free_ids

Manager = KVCacheManager | SpecBackedManager
Factory = Callable[..., Manager]
TEN = list(range(1, 11))  # a 10-token prompt: two full blocks of 4 and half a third


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    factory: Factory = request.param
    return factory


def _pool(make: Factory, total_blocks: int, **kwargs: object) -> tuple[Manager, list[KVCacheEvent]]:
    events: list[KVCacheEvent] = []
    return make(total_blocks, 4, event_sink=events.append, **kwargs), events


def test_a_prompt_stores_its_full_blocks_chained_to_their_parents(make: Factory) -> None:
    pool, events = _pool(make, 8)
    pool.allocate("a", TEN, "t1")
    assert events == [
        BlockStored(0, 0, None, (1, 2, 3, 4), "t1"),
        BlockStored(1, 0, 0, (5, 6, 7, 8), "t1"),
    ]
    assert replay_events(events) == {
        CachedBlock(0, 0, CacheKey("t1", (1, 2, 3, 4))),
        CachedBlock(0, 1, CacheKey("t1", (1, 2, 3, 4, 5, 6, 7, 8))),
    }


def test_a_consumer_that_missed_events_resyncs_from_the_cache_view(make: Factory) -> None:
    pool, events = _pool(make, 12, group_windows=(None, 8))
    pool.allocate("a", TEN, "t1")
    pool.allocate("b", [7, 7, 7, 7, 7])
    pool.release("b")  # its block is cached free; a's two are held
    assert pool.cache_view() == replay_events(events)
    assert pool.cache_view() == {
        CachedBlock(group, block_id, key)
        for group, block_ids in ((0, (0, 1, 6)), (1, (3, 4, 8)))
        for block_id, key in zip(
            block_ids,
            (
                CacheKey("t1", (1, 2, 3, 4)),
                CacheKey("t1", (1, 2, 3, 4, 5, 6, 7, 8)),
                CacheKey(None, (7, 7, 7, 7)),
            ),
            strict=True,
        )
    }
    pool.reset_prefix_cache()
    assert pool.cache_view() == frozenset()


def test_a_hit_a_refused_duplicate_a_release_and_a_fork_emit_nothing(make: Factory) -> None:
    pool, events = _pool(make, 12)
    pool.allocate("a", TEN)
    events.clear()
    pool.allocate("b", TEN)  # hits blocks 0 and 1
    pool.allocate("c", 8)  # by count: never cached
    pool.fork("b", "d")
    pool.release("a")
    pool.release("b")
    pool.release("d")  # blocks 0 and 1 go to the cached free queue, keys kept
    pool.allocate("e", TEN)  # revives them
    assert events == []
    pool.append("e", [11, 12])  # fills block 2, under a new key
    assert events == [BlockStored(6, 0, 1, (9, 10, 11, 12), None)]


def test_a_duplicate_full_block_is_refused_its_key_and_emits_nothing(make: Factory) -> None:
    pool, events = _pool(make, 8)
    pool.allocate("a", [1, 2, 3, 4])  # the whole prompt: block 0 cached, no hit
    pool.allocate("b", [1, 2, 3, 4])  # block 1 holds the same key: refused
    assert events == [BlockStored(0, 0, None, (1, 2, 3, 4), None)]


def test_eviction_removes_each_block_taken_before_anything_is_stored(make: Factory) -> None:
    pool, events = _pool(make, 3)
    pool.allocate("a", TEN)
    pool.release("a")
    assert cached_free_ids(pool) == (1, 0)
    events.clear()
    # Blocks 2 (free), then 1 and 0 (evicted, least recently freed first).
    assert pool.allocate("b", [9, 9, 9, 9, 8, 8, 8, 8, 7]).table().block_ids == (2, 1, 0)
    assert events == [
        BlockRemoved(1, 0),
        BlockRemoved(0, 0),
        BlockStored(2, 0, None, (9, 9, 9, 9), None),
        BlockStored(1, 0, 2, (8, 8, 8, 8), None),
    ]


def test_a_write_into_a_block_a_rollback_kept_removes_it_and_the_refill_stores_it(
    make: Factory,
) -> None:
    pool, events = _pool(make, 8)
    pool.allocate("a", TEN[:8])
    events.clear()
    pool.truncate("a", 6)
    assert events == []  # block 1 still holds 5..8's K/V
    pool.append("a", [7, 0])
    assert events == [BlockRemoved(1, 0), BlockStored(1, 0, 0, (5, 6, 7, 0), None)]


def test_a_reset_emits_one_clear_and_a_later_block_carries_its_whole_prefix(
    make: Factory,
) -> None:
    pool, events = _pool(make, 8)
    pool.allocate("a", TEN)
    events.clear()
    assert pool.reset_prefix_cache() == 2
    assert events == [AllBlocksCleared()]
    # Block 1's prefix is cached nowhere now: block 2's event names no parent and carries
    # all twelve tokens.
    pool.append("a", [11, 12])
    assert events[1:] == [BlockStored(2, 0, None, tuple(range(1, 13)), None)]
    assert pool.reset_prefix_cache() == 1
    assert pool.reset_prefix_cache() == 0
    assert events[2:] == [AllBlocksCleared(), AllBlocksCleared()]


def test_every_group_stores_its_own_blocks_and_a_window_stores_none_it_skipped(
    make: Factory,
) -> None:
    # A full group and a window of 3 tokens: a hit of 8 tokens needs only block 1 there.
    pool, events = _pool(make, 12, group_windows=(None, 3))
    pool.allocate("a", TEN)
    assert events == [
        BlockStored(0, 0, None, (1, 2, 3, 4), None),
        BlockStored(1, 0, 0, (5, 6, 7, 8), None),
        BlockStored(3, 1, None, (1, 2, 3, 4), None),
        BlockStored(4, 1, 3, (5, 6, 7, 8), None),
    ]
    events.clear()
    pool.allocate("b", [*TEN[:8], 0, 0, 0, 0, 5])
    # A hit of 8 tokens. In group 1, b's block index 0 is born skipped, and its new block
    # 8 (index 2) chains to block 4, where the group caches the prefix 1..8.
    assert events == [
        BlockStored(6, 0, 1, (0, 0, 0, 0), None),
        BlockStored(8, 1, 4, (0, 0, 0, 0), None),
    ]


def test_replay_refuses_events_the_view_contradicts() -> None:
    stored = BlockStored(0, 0, None, (1, 2), None)
    with pytest.raises(EventReplayError, match="block 3 in group 0, which the view holds no"):
        replay_events([stored, BlockRemoved(3, 0)])
    with pytest.raises(EventReplayError, match="block 1 in group 0: block 0 caches that key"):
        replay_events([stored, BlockStored(1, 0, None, (1, 2), None)])
    with pytest.raises(EventReplayError, match="names parent block 5, which caches no key"):
        replay_events([BlockStored(1, 0, 5, (3, 4), None)])
    with pytest.raises(EventReplayError, match="salt 'a', parent block 0's None"):
        replay_events([stored, BlockStored(1, 0, 0, (3, 4), "a")])
    with pytest.raises(EventReplayError, match="which the view holds a key for already"):
        replay_events([stored, BlockStored(0, 0, None, (5, 6), None)])


def test_the_sink_must_be_callable() -> None:
    with pytest.raises(TypeError, match="event_sink must be callable or None, got list"):
        KVCacheManager(4, 4, event_sink=[])  # type: ignore[arg-type]


def test_a_write_after_a_rollback_uncaches_only_the_block_it_writes_into(
    make: Factory,
) -> None:
    pool, events = _pool(make, 8)
    pool.allocate("a", [*TEN, 11, 12, 13])  # blocks 0, 1 and 2 full and cached
    events.clear()
    pool.truncate("a", 10)  # into block 2; block 3 (token 13) goes
    assert events == []
    assert pool.cached_prefix_tokens([*TEN, 11, 12, 13]) == 12
    pool.append("a", [0])
    assert events == [BlockRemoved(2, 0)]
    assert pool.cached_prefix_tokens([*TEN, 11, 12, 13]) == 8


def _cache_and_release(manager: KVCacheManager) -> None:
    """Two full blocks cached on the device, then released: written through to the host
    tier, which caches them too."""
    manager.allocate("a", tuple(range(1, 10)))
    manager.release("a")
    manager.take_transfers()


def test_a_manager_without_sinks_keeps_no_events() -> None:
    # With sinks the same calls make device and host events, each delivered by its call.
    device: list[object] = []
    host: list[object] = []
    with_sinks = KVCacheManager(
        8,
        4,
        host_blocks=4,
        host_prefix_cache=True,
        event_sink=device.append,
        host_event_sink=host.append,
    )
    _cache_and_release(with_sinks)
    assert device and host
    without = KVCacheManager(8, 4, host_blocks=4, host_prefix_cache=True)
    _cache_and_release(without)
    # Nothing collected that no one will take: a held event would be held for the run.
    assert without._events.events == [] and without._events.host_events == []
