"""A user's own code, type-checked against the installed wheel by ``tests/test_wheel.py``
(``mypy --strict --disallow-any-expr``): impl's public API, ``harness.check_model`` and
``harness.CheckSettings``.

Not run: it only has to type-check, with no ``Any`` coming out of the public API.
"""

from typing import assert_type

import torch

import harness
from harness import EquivalenceReport, RequestReport
from impl import KVBlockManager


def blocks_of(manager: KVBlockManager, request_id: str, token_count: int) -> list[int]:
    return manager.allocate(request_id, token_count).block_ids


def check(model: torch.nn.Module, tokenizer: object) -> bool:
    report = harness.check_model(model, tokenizer, ["Hello", [1, 2, 3]], max_new_tokens=8)
    assert_type(report, EquivalenceReport)
    assert_type(report.rows, list[RequestReport])
    assert_type(report.failures, list[str])
    assert_type(report.summary(), str)
    assert_type(report.rows[0].batch.margin_ulps, float | None)
    return report.passed


def check_with_settings(model: torch.nn.Module) -> bool:
    settings = harness.CheckSettings(block_size=4, preempt="swap", host_blocks=64)
    assert_type(settings.host_blocks, int | None)
    return harness.check_model(model, None, [[1, 2, 3]], settings, max_new_tokens=8).passed


assert_type(KVBlockManager(8, 4).allocate("r0", 5).block_ids, list[int])
assert_type(KVBlockManager(8, 4).free_blocks, int)
