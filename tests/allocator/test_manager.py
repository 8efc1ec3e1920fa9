"""KVBlockManager's own API beyond the spec's operations."""

from impl import KVBlockManager


def test_the_articles_api_defaults_to_blocks_of_16_tokens() -> None:
    pool = KVBlockManager(4)
    assert pool.block_size == 16
    assert pool.usage().reserved_tokens == 0
    assert pool.allocate("a", 17).block_ids == [0, 1]
