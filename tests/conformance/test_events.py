"""The kit reads vLLM's KV cache events (``take_events()`` of its real ``KVCacheManager``)
and judges them against the spec's stream (``harness.conformance.events``): it catches a
bug planted in vLLM's own emission, and the finding it reports (a hash removed while
another copy stays cached, docs/findings/vllm-kv-events.md) is pinned here in vLLM's own
API. (That vLLM's events hold every rule it does not declare over a seeded run is
``tests/conformance/test_targets.py``'s run of each vLLM configuration, which judges them.)"""

from typing import Any

import pytest
import torch

from harness.conformance import check_target
from harness.conformance.adapter import KV_EVENTS
from harness.conformance.machine import Tally, machine_for
from harness.conformance.targets import CONFIGURATIONS
from tests.conformance import planted_targets as planted

pytest.importorskip("vllm", reason="vllm is not installed (scripts/setup.sh installs it)")


def test_the_kit_judges_vllm_s_premature_remove_a_declared_difference() -> None:
    """The finding's steps through the kit: a prompt of two full blocks admitted twice
    (its second block cached twice), the first request released, and a prompt of ten
    blocks that takes every free block, the first request's copy among them."""
    tally = Tally()
    kit = machine_for(CONFIGURATIONS["vllm-full"], tally)()
    kit.allocate_prompt(token_ids=(1, 2, 3, 1, 2, 3, 1, 2), cache_salt=None)
    kit.allocate_prompt(token_ids=(1, 2, 3, 1, 2, 3, 1, 2), cache_salt=None)
    assert tally.declared["events_stored_twice"] == 1
    kit.release(pick=0)
    kit.allocate_prompt(token_ids=(0,) * 40, cache_salt=None)
    assert tally.declared["events_missing"] == 1


def vllm_forgets_its_removes() -> Any:
    """vLLM's block pool evicting a cached block without its ``BlockRemoved``."""
    from harness.conformance.targets.vllm_v1 import VLLMAdapter  # noqa: PLC0415

    adapter = VLLMAdapter()
    adapter.manager.block_pool._emit_block_removed_events = lambda hashes: None
    adapter.name += " (no BlockRemoved)"
    return adapter


def test_the_kit_catches_a_vllm_that_evicts_without_removing() -> None:
    report = check_target(vllm_forgets_its_removes, steps=4000, seed_value=0)
    found = report.discrepancy
    assert found is not None, f"not caught: {report.describe()}"
    assert "events_extra" in {finding.name for finding in found.bugs()}, found.describe()
    assert len(found.steps) <= 10, f"not shrunk: {found.describe()}"
    assert "property events_extra: BUG" in report.describe()


def test_the_kit_catches_a_salt_that_never_reaches_vllm_by_its_events() -> None:
    """The salt dropped on the way to vLLM (``planted_targets.vllm_drops_the_salt``): the
    stores name unsalted prefixes where the spec caches salted ones, at the first step."""

    def salt_dropped_events_judged() -> Any:
        adapter = planted.vllm_drops_the_salt()
        adapter.supports = adapter.supports | {KV_EVENTS}
        return adapter

    report = check_target(salt_dropped_events_judged, steps=4000, seed_value=0)
    found = report.discrepancy
    assert found is not None, f"not caught: {report.describe()}"
    assert "events_extra" in {finding.name for finding in found.bugs()}, found.describe()
    assert len(found.steps) == 1, f"not shrunk: {found.describe()}"


def test_vllm_removes_a_hash_while_another_block_still_caches_it() -> None:
    """The finding's reproduction: two requests with the same 8-token prompt (2 blocks of
    4) cache its second block twice (the last token is never a hit); evicting the first
    request's copy sends ``BlockRemoved`` for the hash the second request's block still
    caches."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: PLC0415
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
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
    )
    from vllm.v1.request import Request  # noqa: PLC0415

    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=7, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], attention)]
    )
    manager = KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_kv_cache_events=True,
    )
    hasher = get_request_block_hasher(4, sha256)

    def admit(request_id: str, prompt: list[int]) -> Any:
        request = Request(
            request_id, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher
        )
        blocks, hit, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, len(prompt) - hit, hit, blocks) is not None
        return request

    first = admit("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit("b", [1, 2, 3, 4, 5, 6, 7, 8])
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    second_block = stored[0].block_hashes[1]
    assert [e.block_hashes for e in stored] == [stored[0].block_hashes, [second_block]]
    manager.free(first)
    admit("c", [9] * 16)  # takes every free block, "a"'s copy of the second block last
    removed = [
        h for e in manager.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert second_block in removed
    # ... while "b"'s copy still caches it: a prompt with that prefix still hits 8 tokens.
    probe = Request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0], SamplingParams(), None, block_hasher=hasher)
    assert manager.get_computed_blocks(probe)[1] == 8
