"""The zoo's bugs planted in vLLM's own hybrid (Mamba) code, for the ``vllm-mamba``
configuration: each plant, and a direct call into a hybrid ``KVCacheManager`` (a
full-attention group and a Mamba group in align mode, built as vLLM's maintainers would in
a reproduction) whose answer the plant changes. ``tests.conformance.zoo`` lists them.
"""

from typing import Any

import pytest
import torch

from tests.conformance.direct import vllm_request

# Any: vLLM's objects are the untyped boundary.

BLOCK = 4
PROMPT = [1, 2, 3, 1, 2, 3, 0, 0, 1]  # 9 tokens: two full blocks and one token


def vllm_mamba_manager() -> tuple[Any, Any]:
    """A ``KVCacheManager`` of 16 usable blocks (and the null block) over a full-attention
    group and a Mamba group (align mode, one state kept per block), prefix caching on; and
    the block hasher its requests need."""
    from vllm.utils.hashing import sha256  # noqa: PLC0415
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import (  # noqa: PLC0415
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    init_none_hash(sha256)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((2, 8),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    config = KVCacheConfig(
        num_blocks=17,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attention"], full), KVCacheGroupSpec(["mamba"], mamba)],
        prefix_cache_retention_interval=BLOCK,
    )
    manager = KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )
    return manager, get_request_block_hasher(BLOCK, sha256)


def prefill_in_chunks(manager: Any, hasher: Any, prompt: list[int], ends: list[int]) -> Any:
    """Admit ``prompt`` (no hit) and compute it in chunks ending at ``ends``, one step
    each, as the scheduler does (``new_step_starts`` between steps)."""
    request = vllm_request(hasher, "r0", prompt, None)
    start = 0
    for end in ends:
        if start:
            manager.new_step_starts()
        assert manager.allocate_slots(request, end - start) is not None
        request.num_computed_tokens = start = end
    manager.new_step_starts()
    return request


def probe(manager: Any, hasher: Any, prompt: list[int]) -> tuple[int, list[list[int]]]:
    """A new request's hit (tokens) and its hit blocks per group (nothing is allocated)."""
    blocks, hit, _ = manager.get_computed_blocks(vllm_request(hasher, "probe", prompt, None))
    return int(hit), [list(ids) for ids in blocks.get_block_ids()]


# -- a hit one block past the checkpoint it restores (vllm #57128, #53912, #50630) -----------


def checkpoint_one_block_late(mp: pytest.MonkeyPatch) -> None:
    """MambaManager.find_longest_cache_hit finds the last checkpoint a block short of the
    candidate and places it one block later: a hit that restores an earlier state."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: PLC0415

    find: Any = MambaManager.__dict__["find_longest_cache_hit"].__func__

    def planted(cls: Any, block_hashes: Any, max_length: int, *args: Any, **kwargs: Any) -> Any:
        size = kwargs["kv_cache_spec"].block_size
        found, length = find(cls, block_hashes, max_length - size, *args, **kwargs)
        if length == 0:
            return found, length
        null = kwargs["block_pool"].null_block
        return tuple([*blocks[:-1], null, blocks[-1]] for blocks in found), length + size

    mp.setattr(MambaManager, "find_longest_cache_hit", classmethod(planted))


def restored_checkpoint() -> object:
    """Checkpoints at 4 and 8 tokens; a prompt sharing 8 restores the block cached at 8."""
    manager, hasher = vllm_mamba_manager()
    prefill_in_chunks(manager, hasher, PROMPT, [4, 8, 9])
    return probe(manager, hasher, [*PROMPT[:8], 3, 3, 3, 3, 3])


# -- the common hit taken as the max over groups (vllm #45614, #46453) ------------------------


def mamba_shortfall_ignored(mp: pytest.MonkeyPatch) -> None:
    """The Mamba group no longer lowers the common hit: MambaManager.find_longest_cache_hit
    answers the candidate length it was asked about (the full-attention group's hit, the
    max over groups), its last checkpoint at or below it followed by null blocks."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: PLC0415

    find: Any = MambaManager.__dict__["find_longest_cache_hit"].__func__

    def planted(cls: Any, block_hashes: Any, max_length: int, *args: Any, **kwargs: Any) -> Any:
        found, _ = find(cls, block_hashes, max_length, *args, **kwargs)
        size = kwargs["kv_cache_spec"].block_size
        candidate = max_length // size * size
        null = kwargs["block_pool"].null_block
        padded = tuple([*blocks, *[null] * (candidate // size - len(blocks))] for blocks in found)
        return padded, candidate

    mp.setattr(MambaManager, "find_longest_cache_hit", classmethod(planted))


def hit_above_the_last_checkpoint() -> object:
    """Full attention caches 8 tokens, Mamba a checkpoint at 4 only (the second chunk ran
    past 8): a prompt sharing 8 gets a hit of 4."""
    manager, hasher = vllm_mamba_manager()
    prefill_in_chunks(manager, hasher, PROMPT, [4, 9])
    return probe(manager, hasher, [*PROMPT[:8], 3, 3, 3, 3, 3])


# -- a state index in the wrong units (vllm #55600, #53142) ---------------------------------


def state_index_one_block_short(mp: pytest.MonkeyPatch) -> None:
    """MambaManager.find_longest_cache_hit seeds the restored checkpoint's table index one
    block short (one leading null fewer), as an index computed in the wrong block-size
    units does: the checkpoint sits where allocate_slots' remove_skipped_blocks takes it
    for a spent state and frees it, so the request starts from no restored state."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: PLC0415

    find: Any = MambaManager.__dict__["find_longest_cache_hit"].__func__

    def planted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        found, length = find(cls, *args, **kwargs)
        return tuple(blocks[1:] if len(blocks) > 1 else blocks for blocks in found), length

    mp.setattr(MambaManager, "find_longest_cache_hit", classmethod(planted))
