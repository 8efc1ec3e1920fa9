"""The zoo's bug classes planted in transformers 5.23.0's own cache allocator
(``tests.conformance.zoo`` lists them with vLLM's): for each, the monkeypatch that plants it
and the direct call whose answer it changes.
"""

from typing import Any

import pytest

from tests.conformance.direct import transformers_admit, transformers_cache

P8 = [1, 2, 3, 1, 2, 3, 1, 2]  # two full blocks of 4


def marking_skipped(mp: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.cache_allocators import (  # noqa: PLC0415
        FullAttentionCacheAllocator,
    )

    mp.setattr(FullAttentionCacheAllocator, "mark_complete_blocks", lambda self, *a: None)


def transformers_hit_on_a_cached_prompt() -> object:
    cache = transformers_cache()
    transformers_admit(cache, "r0", [*P8, 0])
    return cache.search_prefix_match("probe", [*P8, 1])


def hash_kept_on_a_soft_reset(mp: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (  # noqa: PLC0415
        BlockLedger,
    )

    release = BlockLedger.release

    def planted(self: Any, block_id: int, no_cache: bool = False) -> bool:
        if (
            no_cache
            and block_id in self.block_to_hash
            and self.shared_ref_counts.get(block_id, 1) == 1
        ):
            self.shared_ref_counts.pop(block_id, None)
            return True  # to the pool, its hash still findable
        return bool(release(self, block_id, no_cache))

    mp.setattr(BlockLedger, "release", planted)


def hashes_after_a_soft_reset() -> object:
    cache = transformers_cache()
    transformers_admit(cache, "r0", [*P8, 0])
    cache.free_blocks("r0", no_cache=True)
    return sorted(cache.cache_allocators["full_attention"].ledger.block_to_hash)


def pool_double_free(mp: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.cache_allocators import (  # noqa: PLC0415
        CachePool,
    )

    free_blocks = CachePool.free_blocks

    def planted(self: Any, index: int, block_ids: list[int]) -> None:
        free_blocks(self, index, block_ids + block_ids[:1])  # the first block, twice

    mp.setattr(CachePool, "free_blocks", planted)


def transformers_free_count_after_a_release() -> object:
    cache = transformers_cache()
    transformers_admit(cache, "r0", [0, 1, 2, 3, 0])
    cache.free_blocks("r0")
    return cache.pool.count_free_blocks(0)


def whole_prompt_match(mp: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.cache_allocators import (  # noqa: PLC0415
        CacheAllocator,
    )

    match = CacheAllocator.match_prefix_blocks
    mp.setattr(
        CacheAllocator, "match_prefix_blocks", lambda self, prompt: match(self, [*prompt, -1])
    )


def transformers_hit_on_the_same_prompt() -> object:
    cache = transformers_cache()
    transformers_admit(cache, "r0", P8)
    return cache.search_prefix_match("probe", P8)


def eviction_keeps_hashes(mp: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (  # noqa: PLC0415
        BlockLedger,
    )

    def planted(self: Any) -> list[int]:
        evicted = list(self.cached_blocks)
        self.cached_blocks.clear()
        return evicted  # their hashes stay: a later match finds a block that is gone

    mp.setattr(BlockLedger, "evict_cached_blocks", planted)


def hashes_after_an_eviction() -> object:
    cache = transformers_cache()
    transformers_admit(cache, "r0", [*P8, 0])
    cache.free_blocks("r0")
    cache.evict_cached_blocks()
    return sorted(cache.cache_allocators["full_attention"].ledger.block_to_hash)
