"""Compiled FlexAttention over a paged pool, on one shape (one compile; ``-m slow``).

A decode step of three requests whose last blocks are partly filled: flex must agree with
gather + SDPA when the rows no request owns hold the finite poison flex's pool uses, and
it cannot stay clean when they hold NaN (it reads a partial block's masked rows and
multiplies their V by a zero weight): why ``--attention flex --poison-freed`` poisons with
the dtype's largest finite value.
"""

import pytest
import torch

from harness.runtime.flex_paged import flex_attention_paged, flex_block_mask
from tests.support.paged_steps import RandomStep


def _flex(step: RandomStep) -> torch.Tensor:
    tensors = step.tensors()
    mask = flex_block_mask(tensors, step.keys.shape[0])
    return flex_attention_paged(step.query, (step.keys, step.values), tensors, step.scale, mask)


# NOTE: 167 s (79 s of CPU) for its one compile under load 6 on 2 cores: over CI's budget.
@pytest.mark.slow
def test_flex_agrees_with_gather_over_finite_poison_and_not_over_nan() -> None:
    step = RandomStep([9, 6, 13], [1, 1, 1], 4, (4, 2), seed=7)  # 1, 2 and 1 of 4 rows used
    gathered = step.gathered()
    nan_poisoned = _flex(step)
    largest = torch.finfo(step.keys.dtype).max
    step.keys.nan_to_num_(nan=largest)
    step.values.nan_to_num_(nan=largest)
    torch.testing.assert_close(_flex(step), gathered, rtol=1e-5, atol=1e-5)
    assert nan_poisoned.isnan().any()
