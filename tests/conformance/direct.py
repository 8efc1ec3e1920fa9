"""The targets' own allocators called directly, as their maintainers would in a
reproduction: a small vLLM ``KVCacheManager`` and a small transformers
``PagedAttentionCache``, each with 12 usable blocks of 4 tokens, and one admission helper
each (look up the prefix, allocate the rest, count the prompt as computed).

Used by the findings' scenarios and by the zoo's checks that a planted bug changes what
the library does. vLLM imports happen inside the functions: vLLM is optional.
"""

from typing import Any

import torch

from harness.conformance.targets.transformers_engine import llama_config

# Any: vLLM's and transformers' objects are the untyped boundary.


def vllm_manager(groups: int = 1, window: int = 6, events: bool = False) -> tuple[Any, Any]:
    """A ``KVCacheManager`` of 12 usable blocks (and the null block) with prefix caching:
    one full-attention group, or a full group beside a sliding-window group, emitting KV
    cache events with ``events`` (``take_events()``); and the block hasher its requests
    need."""
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
        SlidingWindowSpec,
    )

    init_none_hash(sha256)
    kinds = [
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16),
        SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=window
        ),
    ][:groups]
    config = KVCacheConfig(
        num_blocks=13,  # 12 usable and the null block
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], kind) for i, kind in enumerate(kinds)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_kv_cache_events=events,
    )
    return manager, get_request_block_hasher(4, sha256)


def vllm_request(hasher: Any, request_id: str, prompt: list[int], cache_salt: str | None) -> Any:
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    params = SamplingParams(max_tokens=64)
    return Request(request_id, prompt, params, None, cache_salt=cache_salt, block_hasher=hasher)


def vllm_admit(
    manager: Any, hasher: Any, request_id: str, prompt: list[int], cache_salt: str | None = None
) -> Any:
    """``get_computed_blocks`` + ``allocate_slots`` + the prompt computed: the request."""
    request = vllm_request(hasher, request_id, prompt, cache_salt)
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - hit, hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return request


def vllm_hit(manager: Any, hasher: Any, prompt: list[int], cache_salt: str | None = None) -> int:
    """The prefix hit a new request of ``prompt`` would get (nothing is allocated)."""
    request = vllm_request(hasher, "probe", prompt, cache_salt)
    return int(manager.get_computed_blocks(request)[1])


def transformers_cache(sliding_window: int | None = None) -> Any:
    """A ``PagedAttentionCache`` of 12 sectors of one 4-token block, for a one-layer Llama
    (or full + sliding-window layers), prefix sharing on when the model allows it."""
    from transformers.generation.configuration_utils import (  # noqa: PLC0415
        ContinuousBatchingConfig,
    )
    from transformers.generation.continuous_batching.cache import (  # noqa: PLC0415
        PagedAttentionCache,
    )
    from transformers.generation.continuous_batching.distributed import (  # noqa: PLC0415
        DistributedHelper,
    )

    config = llama_config(sliding_window)
    cb_config = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=12 // config.num_hidden_layers,
        max_batch_tokens=64,
        max_memory_percent=0.5,
    )
    return PagedAttentionCache(
        config, cb_config, "cpu", DistributedHelper(None, None), dtype=torch.float16
    )


def transformers_admit(cache: Any, request_id: str, prompt: list[int]) -> Any:
    """What the scheduler and ``update_batch`` do for one request's prefill and its
    forward: prefix match, allocation, the forward's completed blocks hashed."""
    from transformers.generation.continuous_batching.requests import (  # noqa: PLC0415
        RequestState,
    )

    state = RequestState(request_id=request_id, initial_tokens=list(prompt))
    hit = cache.search_prefix_match(request_id, list(prompt))
    state.position_offset = hit
    assert cache.can_store_request_tokens(state, len(prompt) - hit)
    complete = cache.count_new_complete_blocks(state, len(prompt) - hit)
    state.position_offset = len(prompt)
    cache.mark_complete_blocks(state, complete)
    return state
