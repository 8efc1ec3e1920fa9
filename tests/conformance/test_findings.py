"""What the long runs found in vLLM and transformers, each as a scenario in the target's own
API (docs/conformance.md, "Findings", has the same steps and the classification). These
pin the behaviour the adapters declare as differences: if a new release changes it, the
scenario fails and the declaration is to be revisited."""

import importlib.util
from typing import Any

import pytest
import torch

import spec
from harness.conformance.targets.transformers_cb import TransformersAdapter

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs the 'conformance' extra)",
)


def _vllm_manager(groups: int) -> tuple[Any, Any]:  # Any: vLLM's objects
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
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=6
        ),
    ][:groups]
    config = KVCacheConfig(
        num_blocks=13,  # 12 usable and the null block
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], kind) for i, kind in enumerate(kinds)],
    )
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=4, hash_block_size=4)
    return manager, get_request_block_hasher(4, sha256)


def _request(hasher: Any, request_id: str, prompt: list[int], cache_salt: str | None) -> Any:
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    params = SamplingParams(max_tokens=64)
    return Request(request_id, prompt, params, None, cache_salt=cache_salt, block_hasher=hasher)


def _admit(
    manager: Any, hasher: Any, request_id: str, prompt: list[int], cache_salt: str | None = None
) -> Any:
    request = _request(hasher, request_id, prompt, cache_salt)
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - hit, hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return request


@needs_vllm
def test_vllm_releases_out_of_window_blocks_even_when_it_refuses_the_allocation() -> None:
    manager, hasher = _vllm_manager(groups=2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    _admit(manager, hasher, "r0", prompt)
    _admit(manager, hasher, "r2", prompt)
    r1 = _admit(manager, hasher, "r1", [1, 2, 3, 1, 2, 3, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == 0
    before = manager.get_block_ids("r1")
    r1.append_output_token_ids([0, 0])
    assert manager.allocate_slots(r1, 2) is None
    after = manager.get_block_ids("r1")
    # Refused, and yet the sliding-window group's first two blocks went (null block 0 in
    # their place) and one of them is free: the spec refuses without changing anything.
    assert before[1][:2] != [0, 0] and after[1][:2] == [0, 0]
    assert pool.get_num_free_blocks() == 1


@needs_vllm
def test_vllm_caches_a_second_block_for_a_prefix_it_caches_already() -> None:
    manager, hasher = _vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    first = manager.get_block_ids(_admit(manager, hasher, "r0", prompt).request_id)[0]
    second = manager.get_block_ids(_admit(manager, hasher, "r1", prompt).request_id)[0]
    # The hit stops one block short (the last token is always computed), so the second
    # block is computed again into a new block, and cached beside the first one.
    assert first[0] == second[0] and first[1] != second[1]
    blocks = manager.block_pool.blocks
    assert blocks[first[1]].block_hash is not None and blocks[second[1]].block_hash is not None
    assert blocks[first[1]].block_hash == blocks[second[1]].block_hash


def test_transformers_fork_copies_a_partly_filled_block_at_once() -> None:
    adapter = TransformersAdapter()
    adapter.allocate_prompt("r0", (1, 2, 3, 1, 2, 3))  # one full block and a half-filled one
    adapter.fork("r0", "r1")
    allocator = adapter.allocators[0]
    parent, child = allocator.block_table["r0"], allocator.block_table["r1"]
    # The full block is shared; the half-filled one is copied now (the spec shares it too
    # and copies it on the next append into it).
    assert parent[0] == child[0] and parent[1] != child[1]
    assert allocator.ledger.shared_ref_counts == {parent[0]: 2}


def test_transformers_sliding_window_group_is_a_ring_buffer_that_never_releases() -> None:
    adapter = TransformersAdapter(sliding_window=6)
    adapter.allocate_prompt("r0", (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2))  # 14 tokens
    full, sliding = (len(a.block_table["r0"]) for a in adapter.allocators)
    # Full attention: ceil(14 / 4) = 4 blocks. The window of 6: ceil(min(14, 6) / 4) = 2,
    # reused in a ring; the spec keeps blocks 2 and 3 (those the next query reads).
    assert (full, sliding) == (4, 2)
    assert adapter.cache.use_prefix_sharing is False  # no prefix hits with a window layer


@needs_vllm
def test_vllm_hits_the_evictable_copy_of_a_prefix_and_refuses_what_the_held_copy_fits() -> None:
    manager, hasher = _vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    r0 = _admit(manager, hasher, "r0", prompt)  # blocks 1, 2
    _admit(manager, hasher, "r1", prompt)  # block 1 hit, block 3 a second copy of block 2
    manager.free(r0)  # block 2: cached, evictable; block 3 holds the same tokens, held
    _admit(manager, hasher, "r3", [0] * 33)  # 9 blocks: block 2 is all that is left
    assert manager.block_pool.get_num_free_blocks() == 1
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    r2 = Request("r2", [*prompt, 0], SamplingParams(max_tokens=64), None, block_hasher=hasher)
    blocks, hit, _ = manager.get_computed_blocks(r2)
    # The 8-token hit takes block 2 (revived: one block) and the 9th token needs one more:
    # refused. Reusing block 3, held by r1 with the same tokens, would need just one.
    assert hit == 8 and blocks.get_block_ids() == ([1, 2],)
    assert manager.allocate_slots(r2, 1, hit, blocks) is None


@needs_vllm
def test_vllm_takes_an_empty_cache_salt_for_none_where_the_spec_keeps_it_apart() -> None:
    # Finding 7: kv_cache_utils mixes the salt in only `if request.cache_salt`.
    manager, hasher = _vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 0]
    _admit(manager, hasher, "r0", prompt)  # unsalted: blocks 1..2 cache (1..8)
    hits = {
        salt: manager.get_computed_blocks(_request(hasher, f"q{salt}", prompt, salt))[1]
        for salt in ("", "a")
    }
    assert hits == {"": 8, "a": 0}
    state = spec.allocate(spec.init(12, 4), "r0", tuple(prompt))
    assert spec.cached_prefix_tokens(state, tuple(prompt), "") == 0
