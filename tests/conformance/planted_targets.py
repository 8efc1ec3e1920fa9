"""pagedkv's own allocator with one planted bug each, for the kit's properties to catch in
exact and refinement mode (bugs planted in vLLM's and transformers' real code: the zoo,
``tests.conformance.zoo``).
"""

from collections.abc import Mapping
from types import MappingProxyType

from harness.conformance import Observation
from harness.conformance.targets.pagedkv import PagedKVAdapter
from impl import KVCacheManager
from spec import ReleasedBlocks


class FreesTheLastBlockTwice(KVCacheManager):
    """A double free: release puts the request's last block on the free queue twice."""

    def release(self, request_id: str) -> ReleasedBlocks:
        released = super().release(request_id)
        if released.freed_block_ids:
            self._pool.free.append(released.freed_block_ids[0])
        return released


class ReportsAHitOneBlockLong(PagedKVAdapter):
    """An off-by-one hit: the adapter reports one block more of the prompt as cached."""

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        hit = super().allocate_prompt(request_id, token_ids, cache_salt)
        return hit + self.block_size if hit else hit


class DropsTheSalt(PagedKVAdapter):
    """A salt that never reaches the allocator (SGLang #23300's shape): every prompt is
    cached and looked up under no salt, so tenants hit each other's blocks."""

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        return super().allocate_prompt(request_id, token_ids)


class ForgetsWhatItComputed(PagedKVAdapter):
    """A prompt's blocks are never cached (vLLM #45238's class): the cache is emptied right
    after each admission, so no later prompt hits what this one computed."""

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        hit = super().allocate_prompt(request_id, token_ids, cache_salt)
        self.manager.reset_prefix_cache()
        return hit


class EmptiesTheCacheOnRelease(PagedKVAdapter):
    """Cached prefixes evicted with no allocation needing their blocks (vLLM #42948's
    class): finishing a request empties the cache."""

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.manager.reset_prefix_cache()


class HidesItsCacheAndMissesHits(PagedKVAdapter):
    """A target that shows no cached block (a user's adapter that cannot see them) and
    whose lookups miss: each prompt is looked up and cached under a salt of its own, so no
    hit is ever found. Only the shadow sees the lost hits."""

    exact = False
    differences: Mapping[str, str] = MappingProxyType({})
    admissions = 0

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        self.admissions += 1
        return super().allocate_prompt(request_id, token_ids, f"own salt {self.admissions}")

    def observe(self) -> Observation:
        shown = super().observe()
        return Observation(
            tables=shown.tables,
            free_block_ids=shown.free_block_ids + shown.cached_free_block_ids,
            ref_counts=shown.ref_counts,
        )
