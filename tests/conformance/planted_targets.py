"""Targets with one planted bug each, for the conformance kit to catch in either mode.

Exact mode: pagedkv's manager with a bug (several come from ``tests.support.planted_bugs``),
or its adapter misreporting. Refinement mode: the real transformers and vLLM allocators,
wrapped so that one of their operations goes wrong the way their bug trackers describe.
"""

from typing import Any

from harness.conformance.adapter import KV_EVENTS
from harness.conformance.targets.pagedkv import PagedKVAdapter
from harness.conformance.targets.transformers_cb import TransformersAdapter
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


# -- refinement mode: transformers' PagedAttentionCache, wrapped --------------------------


class TransformersFreesTwice(TransformersAdapter):
    """A double free (vLLM #42571's shape): the first block of a released request goes
    back to the allocator's free blocks a second time."""

    def release(self, request_id: str) -> None:
        allocator = self.allocators[0]
        blocks = list(allocator.block_table.get(request_id, []))
        super().release(request_id)
        ledger = allocator.ledger
        if (
            blocks
            and blocks[0] not in ledger.shared_ref_counts
            and blocks[0] not in ledger.block_to_hash
        ):
            self.cache.pool.free_blocks(allocator.index, [blocks[0]])


class TransformersHitsOneBlockShort(TransformersAdapter):
    """An off-by-one hit: the prefix match stops one block before the last cached one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for allocator in self.allocators:
            match = allocator.match_prefix_blocks
            allocator.match_prefix_blocks = lambda prompt, match=match: match(prompt)[:-1]


class TransformersLeaksABlock(TransformersAdapter):
    """A leaked block: release forgets the request's last block instead of freeing it."""

    def release(self, request_id: str) -> None:
        for allocator in self.allocators:
            blocks = allocator.block_table.get(request_id)
            if blocks:
                blocks.pop()
        super().release(request_id)


class TransformersKeepsSharedReference(TransformersAdapter):
    """A ref count not dropped: releasing a request leaves its shared blocks' counts as they
    were, so a block another request shares is counted once too often."""

    def release(self, request_id: str) -> None:
        counts = {
            allocator.index: dict(allocator.ledger.shared_ref_counts)
            for allocator in self.allocators
        }
        held = {
            allocator.index: set(allocator.block_table.get(request_id, []))
            for allocator in self.allocators
        }
        super().release(request_id)
        for allocator in self.allocators:
            for block_id, count in counts[allocator.index].items():
                if block_id in held[allocator.index] and count >= 2:
                    allocator.ledger.shared_ref_counts[block_id] = count


def vllm_frees_one_block_early() -> Any:
    """A window freeing one block early: vLLM's sliding-window manager counts one block
    more out of the window than the window rule allows."""
    from harness.conformance.targets.vllm_v1 import VLLMAdapter  # noqa: PLC0415

    adapter = VLLMAdapter(sliding_window=6)
    manager = adapter.manager.coordinator.single_type_managers[1]
    skipped = manager.get_num_skipped_tokens
    manager.get_num_skipped_tokens = lambda computed: skipped(computed) + adapter.block_size
    adapter.name += " (window one block early)"
    return adapter


def vllm_drops_the_salt() -> Any:
    """A salt that never reaches vLLM (SGLang #23300's shape in vLLM's place): the request
    is built without its ``cache_salt``, so tenants hit each other's blocks."""
    from harness.conformance.targets.vllm_v1 import VLLMAdapter  # noqa: PLC0415

    adapter = VLLMAdapter()
    allocate_prompt = adapter.allocate_prompt
    adapter.allocate_prompt = (  # type: ignore[method-assign]
        lambda request_id, token_ids, cache_salt=None: allocate_prompt(request_id, token_ids)
    )
    adapter.name += " (salt dropped)"
    # Its events, judged, catch it first (tests/conformance/test_events.py); this is the
    # hit_maximal property's catch.
    adapter.supports = adapter.supports - {KV_EVENTS}
    return adapter
