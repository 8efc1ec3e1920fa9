"""The limits ``check_model`` holds its settings to: the model's context and the memory."""

import pytest
import torch

from harness.kv_layout import KVLayout
from harness.limits import (
    MEMORY_FRACTION,
    available_bytes,
    check_context,
    check_memory,
    kv_bytes,
)
from harness.runtime.requests import Request
from harness.settings import CheckSettingsError

# 2 layers x 2 (K, V) x 2 heads x 16 x 4 bytes = 512 bytes a token
LAYOUT = KVLayout(2, 2, 16, torch.float32, torch.device("cpu"))
REQUESTS = [Request("r0", (1,) * 10, 6), Request("r1", (1,) * 30, 2, num_continuations=2)]


def test_the_pool_and_the_gates_buffers_are_both_counted() -> None:
    # Pool: 8 blocks x 4 tokens x 512 bytes. Buffers: min(3 sequences, 8 blocks) x 32 tokens.
    assert kv_bytes(REQUESTS, 8, 4, LAYOUT) == (16_384, 49_152)


def test_a_buffer_per_block_at_most_when_blocks_are_fewer_than_sequences() -> None:
    assert kv_bytes(REQUESTS, 2, 16, LAYOUT) == (16_384, 32_768)


def test_a_run_within_the_memory_fraction_is_accepted() -> None:
    check_memory(REQUESTS, 8, 4, LAYOUT, available=2 * (16_384 + 49_152))


def test_a_run_over_the_memory_fraction_is_refused_with_its_numbers() -> None:
    assert MEMORY_FRACTION == 0.5
    with pytest.raises(CheckSettingsError) as refused:
        check_memory(REQUESTS, 8, 4, LAYOUT, available=2 * (16_384 + 49_152) - 2)
    assert refused.value.setting == "total_blocks"
    assert str(refused.value) == (
        "total_blocks 8: the run's K/V needs 65,536 bytes: a pool of 8 blocks x 4 tokens x 512 "
        "bytes (16,384 bytes) and the gate's contiguous buffers (49,152 bytes); the limit is "
        "0.5 of the 131,070 bytes of cpu memory available, 65,535 bytes"
    )


def test_a_request_exactly_as_long_as_the_context_is_accepted() -> None:
    check_context(REQUESTS, context=32)


def test_the_first_request_longer_than_the_context_is_refused() -> None:
    with pytest.raises(CheckSettingsError) as refused:
        check_context(REQUESTS, context=31)
    assert refused.value.setting == "prompts"
    assert str(refused.value) == (
        "r1 is too long: 30 prompt tokens + 2 new = 32 tokens, more than the model's context "
        "of 31 tokens (max_position_embeddings)"
    )


def test_some_cpu_memory_is_available() -> None:
    assert available_bytes(torch.device("cpu")) > 0
