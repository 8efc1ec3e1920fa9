"""The zoo: real bug classes from the trackers, re-planted in vLLM's and transformers' own
functions, for the conformance kit to catch in the real code.

Each ``Mutant`` names its bug class and the tracker issue that reports it, plants it by
monkeypatching one function of the installed library (restored when the test ends), and
has a direct call into the library (``shows``) whose answer the planted bug changes: the
proof that the mutant is live before the kit is asked to find it. ``caught_by`` is the
property whose breach the kit must report, as a bug, with a shrunk run.

vLLM's plants and direct calls are here, transformers' in
``tests.conformance.zoo_transformers``. The kit runs each on the bundled configuration with
its findings declared (``known_findings``), so that what it reports is the planted bug,
not a known finding.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conformance.direct import vllm_admit, vllm_hit, vllm_manager
from tests.conformance.zoo_mamba import (
    checkpoint_one_block_late,
    hit_above_the_last_checkpoint,
    mamba_shortfall_ignored,
    restored_checkpoint,
    state_index_one_block_short,
)
from tests.conformance.zoo_transformers import (
    P8,
    eviction_keeps_hashes,
    hash_kept_on_a_soft_reset,
    hashes_after_a_soft_reset,
    hashes_after_an_eviction,
    marking_skipped,
    pool_double_free,
    transformers_free_count_after_a_release,
    transformers_hit_on_a_cached_prompt,
    transformers_hit_on_the_same_prompt,
    whole_prompt_match,
)


@dataclass(frozen=True)
class Mutant:
    """One bug class planted in a target's real code."""

    name: str
    tracker: str
    configuration: str
    function: str
    plant: Callable[[pytest.MonkeyPatch], None]
    shows: Callable[[], object]
    caught_by: str


# -- vLLM 0.33.0 --------------------------------------------------------------------------


def _double_free(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    free_blocks = BlockPool.free_blocks

    def planted(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(self, blocks)
        freed = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
        if freed:
            self.free_block_queue.append(freed[0])  # the first block freed joins it twice

    mp.setattr(BlockPool, "free_blocks", planted)


def _free_count_after_a_release() -> object:
    manager, hasher = vllm_manager()
    manager.free(vllm_admit(manager, hasher, "r0", [1, 2, 3, 1, 2]))
    return manager.block_pool.get_num_free_blocks()


def _whole_prompt_hit(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415

    get_computed_blocks = KVCacheManager.get_computed_blocks

    def planted(self: Any, request: Any, max_cache_hit_length: int | None = None) -> Any:
        return get_computed_blocks(self, request, max_cache_hit_length or request.num_tokens)

    mp.setattr(KVCacheManager, "get_computed_blocks", planted)


def _hit_on_a_cached_prompt() -> object:
    manager, hasher = vllm_manager()
    vllm_admit(manager, hasher, "r0", P8)
    return vllm_hit(manager, hasher, P8)


def _salt_dropped(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core import kv_cache_utils  # noqa: PLC0415

    extra_keys = kv_cache_utils.generate_block_hash_extra_keys

    def planted(request: Any, start: int, end: int, mm_index: int) -> Any:
        keys, next_index = extra_keys(request, start, end, mm_index)
        kept = tuple(
            k for k in keys or () if not (isinstance(k, tuple) and k[:1] == ("cache_salt",))
        )
        return kept or None, next_index

    mp.setattr(kv_cache_utils, "generate_block_hash_extra_keys", planted)


def _hit_under_another_salt() -> object:
    manager, hasher = vllm_manager()
    vllm_admit(manager, hasher, "r0", [*P8, 0], cache_salt="a")
    return vllm_hit(manager, hasher, [*P8, 0], cache_salt="b")


def _key_kept_after_eviction(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    mp.setattr(BlockPool, "_maybe_evict_cached_block", lambda self, block: False)


def _hit_after_the_block_was_reused() -> object:
    manager, hasher = vllm_manager()
    manager.free(vllm_admit(manager, hasher, "r0", [*P8, 0]))  # blocks 1, 2 cached, free
    vllm_admit(manager, hasher, "r1", [0] * 41)  # 11 blocks: block 2 is evicted and reused
    return vllm_hit(manager, hasher, [*P8, 0])


def _window_one_block_early(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: PLC0415
        SlidingWindowManager,
    )

    skipped = SlidingWindowManager.get_num_skipped_tokens
    mp.setattr(
        SlidingWindowManager,
        "get_num_skipped_tokens",
        lambda self, computed: skipped(self, computed) + self.block_size,
    )


def _tokens_out_of_the_window() -> object:
    manager, _ = vllm_manager(groups=2)
    return manager.coordinator.single_type_managers[1].get_num_skipped_tokens(13)


def _window_never_slides(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: PLC0415
        SlidingWindowManager,
    )

    mp.setattr(SlidingWindowManager, "remove_skipped_blocks", lambda self, *a, **k: None)


def _window_table_after_decoding() -> object:
    manager, hasher = vllm_manager(groups=2)
    request = vllm_admit(manager, hasher, "r0", [0] * 13)
    request.append_output_token_ids([0])
    manager.allocate_slots(request, 1)
    return manager.get_block_ids("r0")[1]


def _shared_count_kept(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    free_blocks = BlockPool.free_blocks

    def planted(self: Any, ordered_blocks: Any) -> None:
        free_blocks(self, [b for b in ordered_blocks if b.ref_cnt < 2])  # shared: kept

    mp.setattr(BlockPool, "free_blocks", planted)


def _shared_block_count_after_a_release() -> object:
    manager, hasher = vllm_manager()
    first = vllm_admit(manager, hasher, "r0", [*P8, 0])
    vllm_admit(manager, hasher, "r1", [*P8, 1])
    manager.free(first)
    return manager.block_pool.blocks[1].ref_cnt


def _free_count_drift(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    count = BlockPool.get_num_free_blocks
    mp.setattr(BlockPool, "get_num_free_blocks", lambda self: max(0, count(self) - 1))


def _free_count() -> object:
    return vllm_manager()[0].block_pool.get_num_free_blocks()


def _never_cached(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    mp.setattr(BlockPool, "cache_full_blocks", lambda self, *a, **k: None)


def _eagle_block_dropped(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: PLC0415
        FullAttentionManager,
    )

    find: Any = FullAttentionManager.__dict__["find_longest_cache_hit"].__func__
    signature = inspect.signature(find)

    def planted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        bound.arguments["drop_eagle_block"] = True
        return find(*bound.args, **bound.kwargs)

    mp.setattr(FullAttentionManager, "find_longest_cache_hit", classmethod(planted))


def _uncached_free_blocks_last(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue  # noqa: PLC0415

    mp.setattr(FreeKVCacheBlockQueue, "prepend_n", FreeKVCacheBlockQueue.append_n)


def _hit_after_allocating_the_uncached_blocks() -> object:
    manager, hasher = vllm_manager()
    manager.free(vllm_admit(manager, hasher, "r0", [*P8, 0]))  # 1, 2 cached; 3 not
    manager.free(vllm_admit(manager, hasher, "r1", [5] * 9))  # 3, 4 cached; 5 not
    manager.block_pool.get_new_blocks(8)  # as many as the uncached free blocks
    return vllm_hit(manager, hasher, [*P8, 0])


def _window_group_never_hits(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: PLC0415
        SlidingWindowManager,
    )

    def planted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        group_ids = kwargs.get("kv_cache_group_ids", args[2] if len(args) > 2 else ())
        return tuple([] for _ in group_ids), 0

    mp.setattr(SlidingWindowManager, "find_longest_cache_hit", classmethod(planted))


def _hybrid_hit_on_a_cached_prompt() -> object:
    manager, hasher = vllm_manager(groups=2)
    vllm_admit(manager, hasher, "r0", [*P8, 0])
    return vllm_hit(manager, hasher, [*P8, 1])


def _evicted_without_removal(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    mp.setattr(BlockPool, "_emit_block_removed_events", lambda self, block_hashes: None)


def _removed_after_an_eviction() -> object:
    manager, hasher = vllm_manager(events=True)
    manager.free(vllm_admit(manager, hasher, "r0", [*P8, 0]))  # blocks 1, 2 cached, free
    vllm_admit(manager, hasher, "r1", [0] * 41)  # 11 blocks: block 2 is evicted and reused
    return [e.block_hashes for e in manager.take_events() if type(e).__name__ == "BlockRemoved"]


def _salt_left_out_of_events(mp: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

    extra_keys = BlockPool._generate_event_extra_keys

    def planted(self: Any, request: Any, start: int, end: int, mm_index: int) -> Any:
        keys, next_index = extra_keys(self, request, start, end, mm_index)
        kept = tuple(
            k for k in keys or () if not (isinstance(k, tuple) and k[:1] == ("cache_salt",))
        )
        return kept or None, next_index

    mp.setattr(BlockPool, "_generate_event_extra_keys", planted)


def _extra_keys_of_a_salted_store() -> object:
    manager, hasher = vllm_manager(events=True)
    vllm_admit(manager, hasher, "r0", [*P8, 0], cache_salt="a")
    return [e.extra_keys for e in manager.take_events() if type(e).__name__ == "BlockStored"]


ZOO: list[Mutant] = [
    Mutant(
        "double free into the free queue", "vLLM #42571; vllm-ascend #15990", "vllm-full",
        "BlockPool.free_blocks", _double_free, _free_count_after_a_release, "conservation",
    ),
    Mutant(
        "a hit covering the whole prompt (one block too long)", "vLLM #3193 (fixed by #3239)",
        "vllm-full", "KVCacheManager.get_computed_blocks", _whole_prompt_hit,
        _hit_on_a_cached_prompt, "raises_only_refusals",
    ),
    Mutant(
        "cache_salt dropped by the hasher", "LMCache #2878; vLLM #51640 (GHSA-qj2w-6f36-hc5w)",
        "vllm-full", "kv_cache_utils.generate_block_hash_extra_keys", _salt_dropped,
        _hit_under_another_salt, "hit_maximal",
    ),
    Mutant(
        "a key kept after eviction", "vLLM #44237; vLLM #4761", "vllm-full",
        "BlockPool._maybe_evict_cached_block", _key_kept_after_eviction,
        _hit_after_the_block_was_reused, "cached_content_exact",
    ),
    Mutant(
        "a window freeing a block early", "vLLM #3385", "vllm-hybrid",
        "SlidingWindowManager.get_num_skipped_tokens", _window_one_block_early,
        _tokens_out_of_the_window, "window_untouched",
    ),
    Mutant(
        "a window that never frees (blocks kept out of the window)", "vLLM #34568", "vllm-hybrid",
        "SlidingWindowManager.remove_skipped_blocks", _window_never_slides,
        _window_table_after_decoding, "table_shape",
    ),
    Mutant(
        "a ref count not dropped", "xLLM #828; vLLM neuralmagic#71", "vllm-full",
        "BlockPool.free_blocks", _shared_count_kept, _shared_block_count_after_a_release,
        "ref_counts",
    ),
    Mutant(
        "free-count drift", "vllm-ascend #14283; vLLM #21351", "vllm-full",
        "BlockPool.get_num_free_blocks", _free_count_drift, _free_count, "refusal_justified",
    ),
    Mutant(
        "a computed block never cached", "vLLM #45238; ROCm/ATOM #939", "vllm-full",
        "BlockPool.cache_full_blocks", _never_cached, _hit_on_a_cached_prompt,
        "computed_findable",
    ),
    Mutant(
        "a hit one block short (the EAGLE drop where none is due)", "vLLM #53670; vLLM #54360",
        "vllm-full", "FullAttentionManager.find_longest_cache_hit", _eagle_block_dropped,
        _hit_on_a_cached_prompt, "hit_maximal",
    ),
    Mutant(
        "cached blocks evicted before uncached free ones", "vLLM #42948 (fixed by #33710)",
        "vllm-full", "FreeKVCacheBlockQueue.prepend_n", _uncached_free_blocks_last,
        _hit_after_allocating_the_uncached_blocks, "eviction_justified",
    ),
    Mutant(
        "a hybrid model's hits fall to zero", "vLLM #45238; vLLM #32802", "vllm-hybrid",
        "SlidingWindowManager.find_longest_cache_hit", _window_group_never_hits,
        _hybrid_hit_on_a_cached_prompt, "hit_maximal",
    ),
    Mutant(
        "an eviction that publishes no BlockRemoved (a router keeps a prefix the engine lost)",
        "LMCache's producer (BlockRemoved on eviction WIP: LMCache #5076, #3938)", "vllm-full",
        "BlockPool._emit_block_removed_events", _evicted_without_removal,
        _removed_after_an_eviction, "events_extra",
    ),
    Mutant(
        "a BlockStored without its cache salt (tenants' prefixes merged at the router)",
        "LMCache #2878's class on the event path; docs/findings/dynamo-kv-indexer.md",
        "vllm-full", "BlockPool._generate_event_extra_keys", _salt_left_out_of_events,
        _extra_keys_of_a_salted_store, "events_extra",
    ),
    Mutant(
        "a computed block never cached", "vLLM #45238; ROCm/ATOM #939", "transformers-full",
        "FullAttentionCacheAllocator.mark_complete_blocks", marking_skipped,
        transformers_hit_on_a_cached_prompt, "computed_findable",
    ),
    Mutant(
        "a key kept when a block goes back to the pool", "vLLM #44237", "transformers-full",
        "BlockLedger.release", hash_kept_on_a_soft_reset, hashes_after_a_soft_reset,
        "cache_sound",
    ),
    Mutant(
        "double free into the free pool", "vLLM #42571", "transformers-full",
        "CachePool.free_blocks", pool_double_free, transformers_free_count_after_a_release,
        "partition",
    ),
    Mutant(
        "a hit covering the whole prompt (one block too long)",
        "transformers #42094 (its edge case); vLLM #3193", "transformers-full",
        "CacheAllocator.match_prefix_blocks", whole_prompt_match,
        transformers_hit_on_the_same_prompt, "hit_maximal",
    ),
    Mutant(
        "a key kept after eviction", "vLLM #4761", "transformers-full",
        "BlockLedger.evict_cached_blocks", eviction_keeps_hashes, hashes_after_an_eviction,
        "cache_sound",
    ),
    Mutant(
        "a hit one block past the Mamba checkpoint it restores",
        "vLLM #57128, #53912, #50630", "vllm-mamba", "MambaManager.find_longest_cache_hit",
        checkpoint_one_block_late, restored_checkpoint, "state_hit_exact",
    ),
    Mutant(
        "the common hit taken as the max over groups (Mamba's shortfall ignored)",
        "vLLM #45614, #46453", "vllm-mamba", "MambaManager.find_longest_cache_hit",
        mamba_shortfall_ignored, hit_above_the_last_checkpoint, "state_hit_exact",
    ),
    Mutant(
        "a restored state's index in the wrong units (one block short)",
        "vLLM #55600 (PR #55601), #53142", "vllm-mamba", "MambaManager.find_longest_cache_hit",
        state_index_one_block_short, restored_checkpoint, "state_hit_exact",
    ),
]  # fmt: skip
