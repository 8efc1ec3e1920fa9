"""``reset_prefix_cache`` between two runs of one engine (the RL loop's weight update): the
same prompt hits nothing after it, and its tokens still pass the dense and gate checks."""

import torch

from harness.oracle.checks import check_batch, check_gate, tie_rule
from harness.runtime.engine import Engine
from harness.runtime.requests import Request
from impl import KVCacheManager
from tests.support.harness_cases import (
    dense,
    dense_trace,
    paged_and_contiguous,
    poisoned_pool,
    tiny_model,
    trace,
)

# A 12-token shared prompt (three blocks of 4), then a tail: a hit covers the 12.
PROMPT = (5, 9, 13, 2, 7, 30, 31, 8, 11, 12, 14, 15, 40, 41, 42)


def test_after_a_reset_the_same_prompt_hits_nothing_and_still_passes() -> None:
    manager = KVCacheManager(24, 4)
    engine = Engine(tiny_model().model, manager, poisoned_pool(24, 4), None, prefix_caching=True)
    hits = {}
    for request_id in ("first", "again"):
        hits[request_id] = engine.run([Request(request_id, PROMPT, 5)]).prefix_hit_tokens
    assert manager.reset_prefix_cache() > 0
    after = engine.run([Request("reset", PROMPT, 5)])
    hits["reset"] = after.prefix_hit_tokens
    # The repeat hits the three shared blocks; after the reset nothing is cached to hit.
    assert hits == {"first": 0, "again": 12, "reset": 0}
    request = Request("reset", PROMPT, 5)
    paged = trace(after, "reset")
    assert check_batch("reset", paged, dense_trace(dense(request)), tie_rule(torch.float32)).passed
    gate_paged, contiguous = paged_and_contiguous(
        [request], manager_type=KVCacheManager, total_blocks=24, block_size=4
    )
    assert check_gate("reset", paged, trace(contiguous, "reset")).passed
    assert check_gate("reset", trace(gate_paged, "reset"), trace(contiguous, "reset")).passed
