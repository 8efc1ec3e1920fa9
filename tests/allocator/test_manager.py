"""The managers' own behaviour beyond the spec's operations: the article layer's defaults,
and how much a prefix lookup hashes."""

from impl import KVBlockManager, KVCacheManager


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
