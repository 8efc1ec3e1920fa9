"""What the kit found in vLLM and transformers, each pinned in the target's own API.

The two findings (docs/findings/): the kit reports each by its own properties on the
bundled configuration, and the reproduction of the upstream issue shows it in the
library's API. Then the policy differences the adapters declare (docs/conformance.md,
"Declared differences"): if a new release changes one, its scenario fails and the
declaration is to be revisited.
"""

import importlib.util
from collections.abc import Callable
from typing import Any, get_args

import pytest
import torch

import spec
from harness.conformance import check_target
from harness.conformance.events import EVENT_RULES
from harness.conformance.report import statement
from harness.conformance.targets import configuration
from spec.event_stream import StreamRule
from tests.conformance.direct import (
    transformers_admit,
    transformers_cache,
    vllm_admit,
    vllm_hit,
    vllm_manager,
    vllm_request,
)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs the 'conformance' pins)",
)


def test_each_rule_a_stream_can_break_is_a_finding_stated_in_one_line() -> None:
    """A broken stream rule is reported as ``events_<rule>``: the kit states each rule the
    spec's checker names, and no other."""
    assert set(EVENT_RULES) == {f"events_{rule}" for rule in get_args(StreamRule)}
    assert statement("events_parent_order") == EVENT_RULES["events_parent_order"]


# -- finding: transformers does not cache the blocks of a request's last forward ----------


def test_the_kit_finds_that_transformers_never_caches_a_last_forward() -> None:
    report = check_target(configuration("transformers-full"), steps=2000, seed=1, shrink_seconds=10)
    assert report.discrepancy is not None
    (bug,) = report.discrepancy.bugs()
    assert (bug.name, bug.operation) == ("computed_findable", "release")
    assert "release(" in report.describe()


@pytest.mark.parametrize(
    ("prompt_tokens", "new_tokens", "cached"), [(32, 1, 0), (32, 2, 2), (31, 2, 1)]
)
def test_transformers_caches_no_block_its_last_forward_completes(
    prompt_tokens: int, new_tokens: int, cached: int
) -> None:
    # The reproduction in docs/findings/transformers-last-forward.md, through the public
    # ContinuousBatchingManager on a tiny random model (page_size 16).
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    from transformers.generation.configuration_utils import (  # noqa: PLC0415
        ContinuousBatchingConfig,
    )

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=16, num_blocks=16, max_batch_tokens=64
        ),
    )
    manager.start()
    try:
        manager.add_request(list(range(1, prompt_tokens + 1)), request_id="a")
        assert manager.get_result(request_id="a", timeout=120) is not None
        processor = manager.batch_processor
        assert processor is not None
        ledger = processor.cache.cache_allocators["full_attention"].ledger
        # 32 prompt tokens fill 2 blocks; the last forward computes token 32 (1 new
        # token: the prefill) or token 33 (2 new tokens); with 31 prompt tokens and 2 new
        # ones the last forward fills block 2. A block that forward fills is not cached.
        assert len(ledger.block_to_hash) == cached
    finally:
        manager.stop(block=True)


# -- finding: vLLM evicts a unique cached prefix and keeps a redundant copy -----------------


def vllm_declaring(finding: str) -> Callable[[], Any]:
    """vllm-full with one of its findings declared, so that a run reports the other."""

    def make() -> Any:
        from harness.conformance.targets.vllm_differences import FINDINGS  # noqa: PLC0415

        engine: Any = configuration("vllm-full")()
        engine.differences = {**engine.differences, finding: FINDINGS[finding]}
        return engine

    return make


@needs_vllm
def test_the_kit_finds_that_vllm_evicts_a_unique_prefix_before_a_redundant_copy() -> None:
    report = check_target(vllm_declaring("events_missing"), steps=3000, seed=1, shrink_seconds=10)
    assert report.discrepancy is not None
    bugs = {(bug.name, bug.operation) for bug in report.discrepancy.bugs()}
    assert bugs == {("eviction_justified", "duplicate")}


@needs_vllm
def test_vllm_keeps_the_copy_and_evicts_the_unique_prefix() -> None:
    # The reproduction in docs/findings/vllm-duplicate-blocks.md.
    manager, hasher = vllm_manager()
    unique, repeated = [9, 9, 9, 9, 0], [1, 2, 3, 1, 2, 3, 1, 2]
    manager.free(vllm_admit(manager, hasher, "u", unique))  # caches [9, 9, 9, 9]
    manager.free(vllm_admit(manager, hasher, "a1", repeated))
    manager.free(vllm_admit(manager, hasher, "a2", repeated))  # hit 4, block 2 cached again
    hashes = [b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None]
    assert (len(hashes), len(set(hashes))) == (4, 3)  # one key held by two blocks
    manager.free(vllm_admit(manager, hasher, "big", [0] * 33))  # 9 blocks: one eviction
    hashes = [b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None]
    assert len(hashes) - len(set(hashes)) == 1  # the redundant copy is still there ...
    assert vllm_hit(manager, hasher, unique) == 0  # ... and the unique prefix is gone
    assert vllm_hit(manager, hasher, repeated) == 4


# -- finding: vLLM removes a hash while another block still caches it ----------------------


@needs_vllm
def test_the_kit_finds_that_vllm_removes_a_hash_a_copy_still_caches() -> None:
    factory = vllm_declaring("eviction_justified/duplicate")
    report = check_target(factory, steps=3000, seed=1, shrink_seconds=10)
    assert report.discrepancy is not None
    assert {bug.name for bug in report.discrepancy.bugs()} == {"events_missing"}


@needs_vllm
def test_the_finding_s_steps_through_the_kit_lose_a_key_the_caches_hold() -> None:
    """The finding's steps through the engine adapter: a prompt of two full blocks admitted
    twice (its second block cached twice), the first request finished, and a prompt of nine
    blocks that takes every free block, the first request's copy among them: the event
    stream loses a key the caches hold."""
    from harness.conformance.judge import Tally  # noqa: PLC0415
    from harness.conformance.machine import machine_for  # noqa: PLC0415
    from harness.conformance.report import DiscrepancyError  # noqa: PLC0415

    kit: Any = machine_for(configuration("vllm-full"), Tally())()
    prompt = (1, 2, 3, 1, 2, 3, 1, 2)
    kit.arrive(token_ids=prompt, cache_salt=None)
    kit.step(sampled=0, finishing=frozenset())
    kit.arrive(token_ids=prompt, cache_salt=None)
    kit.step(sampled=0, finishing=frozenset({"r0"}))
    kit.arrive(token_ids=(0,) * 33, cache_salt=None)
    with pytest.raises(DiscrepancyError) as raised:
        kit.step(sampled=0, finishing=frozenset())
    assert {bug.name for bug in raised.value.bugs()} == {"events_missing"}


@needs_vllm
def test_vllm_removes_a_hash_while_another_block_still_caches_it() -> None:
    # The reproduction in docs/findings/vllm-kv-events.md: two requests with the same
    # 8-token prompt cache its second block twice (the last token is never a hit);
    # evicting the first request's copy sends BlockRemoved for the hash the second
    # request's block still caches.
    manager, hasher = vllm_manager(events=True)
    first = vllm_admit(manager, hasher, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    vllm_admit(manager, hasher, "b", [1, 2, 3, 4, 5, 6, 7, 8])
    stored = [e.block_hashes for e in manager.take_events() if type(e).__name__ == "BlockStored"]
    second_block = stored[0][1]
    assert stored == [stored[0], [second_block]]
    manager.free(first)
    vllm_admit(manager, hasher, "c", [9] * 40)  # every free block, "a"'s copy of block 2 last
    removed = [
        h
        for e in manager.take_events()
        if type(e).__name__ == "BlockRemoved"
        for h in e.block_hashes
    ]
    assert second_block in removed
    # ... while "b"'s copy still caches it: a prompt with that prefix still hits 8 tokens.
    assert vllm_hit(manager, hasher, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


# -- declared policy differences --------------------------------------------------------------


@needs_vllm
def test_vllm_releases_out_of_window_blocks_even_when_it_refuses_the_allocation() -> None:
    manager, hasher = vllm_manager(groups=2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    vllm_admit(manager, hasher, "r0", prompt)
    vllm_admit(manager, hasher, "r2", prompt)
    r1 = vllm_admit(manager, hasher, "r1", [1, 2, 3, 1, 2, 3, 0, 0, 1, 0, 0, 0, 0, 0, 0])
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
    manager, hasher = vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    first = manager.get_block_ids(vllm_admit(manager, hasher, "r0", prompt).request_id)[0]
    second = manager.get_block_ids(vllm_admit(manager, hasher, "r1", prompt).request_id)[0]
    # The hit stops one block short (the last token is always computed), so the second
    # block is computed again into a new block, and cached beside the first one.
    assert first[0] == second[0] and first[1] != second[1]
    blocks = manager.block_pool.blocks
    assert blocks[first[1]].block_hash is not None and blocks[second[1]].block_hash is not None
    assert blocks[first[1]].block_hash == blocks[second[1]].block_hash


@needs_vllm
def test_vllm_hits_the_evictable_copy_of_a_prefix_and_refuses_what_the_held_copy_fits() -> None:
    manager, hasher = vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    r0 = vllm_admit(manager, hasher, "r0", prompt)  # blocks 1, 2
    vllm_admit(manager, hasher, "r1", prompt)  # block 1 hit, block 3 a second copy of block 2
    manager.free(r0)  # block 2: cached, evictable; block 3 holds the same tokens, held
    vllm_admit(manager, hasher, "r3", [0] * 33)  # 9 blocks: block 2 is all that is left
    assert manager.block_pool.get_num_free_blocks() == 1
    r2 = vllm_request(hasher, "r2", [*prompt, 0], None)
    blocks, hit, _ = manager.get_computed_blocks(r2)
    # The 8-token hit takes block 2 (revived: one block) and the 9th token needs one more:
    # refused. Reusing block 3, held by r1 with the same tokens, would need just one.
    assert hit == 8 and blocks.get_block_ids() == ([1, 2],)
    assert manager.allocate_slots(r2, 1, hit, blocks) is None


@needs_vllm
def test_vllm_takes_an_empty_cache_salt_for_none_where_the_spec_keeps_it_apart() -> None:
    # kv_cache_utils mixes the salt in only `if request.cache_salt`.
    manager, hasher = vllm_manager(groups=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 0]
    vllm_admit(manager, hasher, "r0", prompt)  # unsalted: blocks 1..2 cache (1..8)
    hits = {salt: vllm_hit(manager, hasher, prompt, salt) for salt in ("", "a")}
    assert hits == {"": 8, "a": 0}
    state = spec.allocate(spec.init(12, 4), "r0", tuple(prompt))
    assert spec.cached_prefix_tokens(state, tuple(prompt), "") == 0


def test_transformers_fork_copies_a_partly_filled_block_at_once() -> None:
    cache = transformers_cache()
    parent = transformers_admit(cache, "r0", [1, 2, 3, 1, 2, 3])  # a full block, half of one
    copies: dict[str, tuple[list[int], list[int]]] = {"full_attention": ([], [])}
    assert cache.prepare_fork_request(parent, ["r1"], copies) == ["r1"]
    allocator = cache.cache_allocators["full_attention"]
    first, second = allocator.block_table["r0"], allocator.block_table["r1"]
    # The full block is shared; the half-filled one is copied now (the spec shares it too
    # and copies it on the next append into it).
    assert first[0] == second[0] and first[1] != second[1]
    assert allocator.ledger.shared_ref_counts == {first[0]: 2}


def test_transformers_sliding_window_group_is_a_ring_buffer_that_never_releases() -> None:
    cache = transformers_cache(sliding_window=6)
    transformers_admit(cache, "r0", [1, 2, 3] * 4 + [1, 2])  # 14 tokens
    full, sliding = (len(a.block_table["r0"]) for a in cache.cache_allocators.values())
    # Full attention: ceil(14 / 4) = 4 blocks. The window of 6: ceil(min(14, 6) / 4) = 2,
    # reused in a ring; the spec keeps blocks 2 and 3 (those the next query reads).
    assert (full, sliding) == (4, 2)
    assert cache.use_prefix_sharing is False  # no prefix hits with a window layer
