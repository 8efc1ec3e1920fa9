"""The varlen emulator against gather + SDPA on random pools, and the planted bugs it must show.

Every pool row that is not one of a request's keys is NaN, so a read past ``seqused_k``
or past a table shows as NaN. Block sizes 1 to 256; decodes, whole and partial prefills
in one step; GQA (4 query heads on 2 KV heads) and plain multi-head.
"""

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.runtime import varlen_emulator
from tests.support.paged_steps import RandomStep


def assert_agrees_with_gather(step: RandomStep) -> None:
    emulated = step.emulated()
    assert not emulated.isnan().any(), "the emulator read a row no request owns"
    torch.testing.assert_close(emulated, step.gathered(), rtol=1e-5, atol=1e-5)


@st.composite
def random_steps(draw: st.DrawFn, block_size: int) -> RandomStep:
    """A step of 1-4 requests of up to 3 blocks (and past a block edge), each feeding one
    token (decode), all of them (whole prefill) or some (partial prefill)."""
    count = draw(st.integers(1, 4))
    token_counts = [draw(st.integers(1, 3 * block_size + 1)) for _ in range(count)]
    new_token_counts = [
        draw(st.sampled_from([1, tokens, max(1, tokens // 2)])) for tokens in token_counts
    ]
    heads = draw(st.sampled_from([(4, 2), (2, 2), (4, 1)]))
    return RandomStep(token_counts, new_token_counts, block_size, heads, draw(st.integers(0, 99)))


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_the_emulator_agrees_with_gather_on_random_pools(block_size: int) -> None:
    @settings(max_examples=10)
    @given(random_steps(block_size))
    def agrees(step: RandomStep) -> None:
        assert_agrees_with_gather(step)

    agrees()


def test_a_mixed_step_of_decode_whole_and_partial_prefill_agrees_with_gather() -> None:
    # decode (1 of 9), whole prefill (5 of 5), partial prefill (3 of 7), GQA 4 on 2
    assert_agrees_with_gather(RandomStep([9, 5, 7], [1, 5, 3], 4, (4, 2), seed=3))


# -- planted bugs: each must make the emulator disagree with gather ------------------------


def _top_left_causal(query_count: int, key_count: int, device: torch.device) -> torch.Tensor:
    return torch.ones(query_count, key_count, dtype=torch.bool, device=device).tril()


def _reads_one_row_past(block_row: torch.Tensor, key_count: int, block_size: int) -> torch.Tensor:
    # the keys one row later: the last one past seqused_k, or past the table on a block edge
    positions = torch.arange(1, key_count + 1)
    return block_row.long()[positions // block_size] * block_size + positions % block_size


PLANTED: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    "top-left causal": ("causal_mask", _top_left_causal),
    "reading past a table": ("key_slots", _reads_one_row_past),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_kernel_contract_bug_makes_the_emulator_disagree(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, planted = PLANTED[bug]
    monkeypatch.setattr(varlen_emulator, name, planted)
    # a partial prefill ending on a block edge (8 of 8 rows) and one inside a block
    with pytest.raises((AssertionError, IndexError, RuntimeError)):
        assert_agrees_with_gather(RandomStep([8, 7], [3, 3], 4, (4, 2), seed=5))
