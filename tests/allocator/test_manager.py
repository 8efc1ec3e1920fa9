"""The managers' own behaviour beyond the spec's operations: the article layer's defaults,
how much a prefix lookup hashes, and the decode append's in-block fast path."""

import pytest

from impl import KVBlockManager, KVCacheManager
from impl.groups import KVCacheGroups
from impl.spec_backed import SpecBackedManager


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
