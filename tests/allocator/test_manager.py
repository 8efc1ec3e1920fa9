"""The managers' own behaviour beyond the spec's operations: the article layer's defaults,
how much a prefix lookup hashes, the decode append's in-block fast path, and the by-count
seam the article layer calls (``allocate_tokens``, ``append_tokens``, ``append_slot``)."""

import pytest

from impl import KVBlockManager, KVCacheManager, RequestBlockTable
from impl.groups import KVCacheGroups
from impl.spec_backed import SpecBackedManager
from spec import BlockRemoved, KVCacheEvent


def test_the_articles_api_defaults_to_blocks_of_16_tokens() -> None:
    pool = KVBlockManager(4)
    assert pool.block_size == 16
    assert pool.usage().reserved_tokens == 0
    assert pool.allocate("a", 17).block_ids == [0, 1]


def test_a_prefix_lookup_hashes_no_block_past_the_first_a_full_group_misses() -> None:
    hashed: list[tuple[int, ...]] = []

    def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
        hashed.append(token_ids)
        return hash((parent_hash, token_ids))

    pool = KVCacheManager(8, 2, block_hash=block_hash)
    pool.allocate("a", [1, 2, 3])  # hashes (1, 2): block 0 cached
    hashed.clear()
    assert pool.cached_prefix_tokens([1, 2, 5, 6, 7, 8, 9]) == 2
    assert hashed == [(1, 2), (5, 6)]  # (5, 6) misses: (7, 8) is never hashed


@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_an_append_without_a_count_adds_one_token(
    make: type[KVCacheManager | SpecBackedManager],
) -> None:
    pool = make(8, 4)
    pool.allocate("a", 2)
    assert pool.append("a").slots == ((2,),)
    assert pool.tables("a")[0].token_count == 3


def test_an_in_block_append_by_count_never_reaches_the_growth_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NOTE in ``KVCacheManager.append``: the decode append's in-block case is inlined,
    a single token and one that fills the block's last slot alike."""

    def grow(*args: object) -> None:
        raise AssertionError("an in-block append called KVCacheGroups.grow")

    pool = KVCacheManager(8, 4)
    pool.allocate("a", 1)
    monkeypatch.setattr(KVCacheGroups, "grow", grow)
    assert pool.append("a", 1).slots == ((1,),)
    assert pool.append("a", 2).slots == ((2, 3),)  # room 2: the block's last two slots
    assert pool.tables("a")[0].token_count == 4


def test_the_seams_in_block_appends_never_reach_the_growth_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NOTEs in ``KVCacheManager.append_slot`` and ``append_tokens``: each takes the
    in-block case itself."""

    def grow(*args: object) -> None:
        raise AssertionError("an in-block append called KVCacheGroups.grow")

    pool = KVCacheManager(8, 4)
    pool.allocate_tokens("a", 1)
    monkeypatch.setattr(KVCacheGroups, "grow", grow)
    assert pool.append_slot("a") == 1
    assert pool.append_tokens("a", 2) == RequestBlockTable("a", [0], 4)


def test_the_seam_refuses_a_request_that_tracks_token_ids_and_changes_nothing() -> None:
    pool = KVCacheManager(8, 4)
    pool.allocate("a", [1, 2])
    before = pool.to_spec()
    with pytest.raises(ValueError, match=r"cannot append a count \(1\) to request 'a'"):
        pool.append_slot("a")
    with pytest.raises(ValueError, match=r"cannot append a count \(2\) to request 'a'"):
        pool.append_tokens("a", 2)
    with pytest.raises(TypeError, match=r"token_count must be an int, got list \[1, 2\]"):
        pool.allocate_tokens("b", [1, 2])  # type: ignore[arg-type]
    assert pool.to_spec() == before


def test_the_seam_delivers_the_events_of_the_cached_blocks_it_takes() -> None:
    events: list[KVCacheEvent] = []
    pool = KVCacheManager(4, 2, event_sink=events.append)
    pool.allocate("a", [1, 2, 3, 4])  # caches blocks 0 and 1
    pool.release("a")  # free queue (2, 3), cached free queue (1, 0)
    events.clear()
    assert pool.allocate_tokens("b", 4) == RequestBlockTable("b", [2, 3], 4)
    assert events == []
    assert pool.append_slot("b") == 2  # opens block 1: evicts it
    assert events == [BlockRemoved(1, 0)]
    assert pool.append_tokens("b", 2) == RequestBlockTable("b", [2, 3, 1, 0], 7)
    assert events == [BlockRemoved(1, 0), BlockRemoved(0, 0)]
