"""``impl.event_publisher.EventPublisher``, impl's producer of the stream: the host prefix
cache's keys as medium ``"CPU"``, batch numbers, resync, and events it cannot place.
(Lockstep and the bounded walk check its stream after every step.)"""

import pytest

from impl import KVCacheManager
from impl.event_publisher import EventPublisher
from spec import BlockRemoved, BlockStored
from spec.event_stream import KeyRemoved, KeyStored
from spec.events import AllBlocksCleared, EventReplayError


def stored(events: tuple[object, ...], medium: str) -> set[tuple[int, int | None]]:
    return {
        (e.block_hash, e.parent_block_hash)
        for e in events
        if isinstance(e, KeyStored) and e.medium == medium
    }


def test_a_demoted_prefix_is_published_on_the_host_under_the_device_key_s_hashes() -> None:
    publisher = EventPublisher(2)
    manager = KVCacheManager(
        3,
        2,
        host_blocks=2,
        host_prefix_cache=True,
        event_sink=publisher.record,
        host_event_sink=publisher.record_host,
    )
    manager.allocate("a", [1, 2, 3, 4, 5])
    (device,) = publisher.end_step()
    manager.release("a")
    manager.take_transfers()
    (host,) = publisher.end_step()
    assert (device.seq, host.seq) == (0, 1)  # the first batch is 0 unless told otherwise
    assert len(stored(device.events, "GPU")) == 2
    assert stored(host.events, "CPU") == stored(device.events, "GPU")
    # A new prompt takes the device blocks (GPU removes) and a later demotion the host's.
    manager.allocate("b", [7, 7, 7, 7, 7])
    (evicted,) = publisher.end_step()
    assert {e.medium for e in evicted.events if isinstance(e, KeyRemoved)} == {"GPU"}
    manager.release("b")
    (demoted,) = publisher.end_step()
    removed = {e.block_hash for e in demoted.events if isinstance(e, KeyRemoved)}
    assert {e.medium for e in demoted.events if isinstance(e, KeyRemoved)} == {"CPU"}
    assert removed <= {block_hash for block_hash, _ in stored(host.events, "CPU")}
    assert len(removed) == 2


def test_a_resync_clears_then_stores_every_present_key_in_a_batch_of_its_own() -> None:
    publisher = EventPublisher(2, first_seq=7)
    manager = KVCacheManager(4, 2, event_sink=publisher.record)
    manager.allocate("a", [1, 2, 3, 4, 5])
    step, resync = publisher.resync()
    assert (step.seq, resync.seq) == (7, 8)
    assert isinstance(resync.events[0], AllBlocksCleared)
    assert stored(resync.events[1:], "GPU") == stored(step.events, "GPU")
    assert publisher.end_step() == ()


def test_a_salted_prefix_resyncs_to_the_hashes_it_was_stored_under() -> None:
    # The salt is in the first block's hash only, so a second block's store does not show
    # it: the key remembered for the resync must keep it.
    publisher = EventPublisher(2)
    manager = KVCacheManager(4, 2, event_sink=publisher.record)
    manager.allocate("a", [1, 2, 3, 4, 5], cache_salt="tenant")
    step, resync = publisher.resync()
    assert len(stored(step.events, "GPU")) == 2
    assert stored(resync.events[1:], "GPU") == stored(step.events, "GPU")


def test_an_event_the_remembered_blocks_contradict_is_refused() -> None:
    publisher = EventPublisher(2)
    with pytest.raises(EventReplayError, match="the block caches nothing"):
        publisher.record(BlockRemoved(3, 0))
    with pytest.raises(EventReplayError, match="its parent block caches nothing"):
        publisher.record_host(BlockStored(1, 0, 0, (1, 2), None))


def test_a_host_event_sink_that_cannot_be_called_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="host_event_sink must be callable or None, got list"):
        KVCacheManager(4, 2, host_event_sink=[])  # type: ignore[arg-type]


def test_a_salted_orphan_s_parent_is_its_own_salted_prefix_not_an_unsalted_one() -> None:
    # An orphan (its parent block cached nowhere: the event carries the whole prefix) under
    # a salt, while the same tokens' unsalted prefix is present: its parent hash is the
    # salted prefix's, which no block publishes, so it is computed, never borrowed.
    publisher = EventPublisher(2)
    publisher.record(BlockStored(0, 0, None, (1, 2), None))
    publisher.record(BlockStored(5, 0, None, (1, 2, 3, 4), "tenant"))
    (batch,) = publisher.end_step()
    unsalted, orphan = [e for e in batch.events if isinstance(e, KeyStored)]
    salted_prefix = EventPublisher(2)
    salted_prefix.record(BlockStored(0, 0, None, (1, 2), "tenant"))
    ((salted,),) = [
        [e for e in b.events if isinstance(e, KeyStored)] for b in salted_prefix.end_step()
    ]
    assert orphan.parent_block_hash == salted.block_hash != unsalted.block_hash
