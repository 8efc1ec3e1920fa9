"""The three checks on hand-made logits: what passes, what is a tie, what fails and how."""

import pytest
import torch

from harness.oracle.checks import (
    TIE_ULPS,
    TieRule,
    TokenTrace,
    check_alone,
    check_batch,
    check_gate,
    margin_in_ulps,
    max_logprob_delta,
    tie_rule,
    top2_margin,
    ulp,
)

FLOAT32 = tie_rule(torch.float32)


def _logits(*pairs: tuple[int, float]) -> torch.Tensor:
    row = torch.zeros(16)
    for token_id, value in pairs:
        row[token_id] = value
    return row


def test_identical_traces_pass_the_bitwise_checks() -> None:
    trace = TokenTrace([3, 4], [_logits((3, 2.0)), _logits((4, 2.0))])
    assert check_gate("a", trace, trace).passed
    assert check_alone("a", trace, trace).detail == "bit-identical"


def test_a_one_ulp_logit_difference_fails_the_bitwise_checks_with_the_step() -> None:
    ours = TokenTrace([3, 4], [_logits((3, 2.0)), _logits((4, 2.0))])
    nudged = _logits((4, 2.0))
    nudged[0] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    theirs = TokenTrace([3, 4], [_logits((3, 2.0)), nudged])
    outcome = check_gate("a", ours, theirs)
    assert not outcome.passed
    assert outcome.detail.startswith("a: step 1: logits differ")
    assert "paged token 4 vs contiguous token 4" in outcome.detail


def test_nan_logits_fail_and_report_an_infinite_difference() -> None:
    ours = TokenTrace([0], [torch.full((16,), float("nan"))])
    theirs = TokenTrace([3], [_logits((3, 2.0))])
    outcome = check_alone("a", ours, theirs)
    assert not outcome.passed
    assert "max |diff| inf" in outcome.detail


def test_a_divergence_at_a_near_tie_is_a_reported_tie() -> None:
    reference = TokenTrace([3, 5], [_logits((3, 2.0)), _logits((5, 2.0), (6, 1.9999))])
    ours = TokenTrace([3, 6], [_logits((3, 2.0)), _logits((5, 1.9999), (6, 2.0))])
    outcome = check_batch("a", ours, reference, FLOAT32)
    assert outcome.passed and outcome.tie
    assert "step 1: paged token 6 != generate token 5" in outcome.detail


def test_a_divergence_with_a_clear_margin_fails_with_both_tokens_and_the_margin() -> None:
    reference = TokenTrace([5], [_logits((5, 2.0), (6, 1.0))])
    ours = TokenTrace([6], [_logits((5, 1.0), (6, 2.0))])
    outcome = check_batch("a", ours, reference, FLOAT32)
    assert not outcome.passed
    assert (
        outcome.detail == "a: step 0: paged token 6 != generate token 5, reference top-2 "
        "margin 1 = 4.19e+06 ulp of its top-1 logit 2 in float32"
    )
    assert outcome.margin_ulps == 2**22


def test_a_near_tie_outside_the_other_sides_top5_fails() -> None:
    reference = TokenTrace([5], [_logits((5, 2.0), (6, 1.9999))])
    # Our token 9 is not in the reference's top 5 (ties at 0.0 rank lower indices first).
    ours = TokenTrace([9], [_logits((9, 3.0))])
    assert not check_batch("a", ours, reference, FLOAT32).passed


def test_different_lengths_fail_check_3() -> None:
    reference = TokenTrace([5, 5], [_logits((5, 2.0))] * 2)
    ours = TokenTrace([5], [_logits((5, 2.0))])
    outcome = check_batch("a", ours, reference, FLOAT32)
    assert not outcome.passed
    assert outcome.detail == "a: 1 tokens vs generate's 2"


def test_top2_margin_and_logprob_delta() -> None:
    assert top2_margin(_logits((1, 3.0), (2, 1.0))) == 2.0
    reference = TokenTrace([1], [_logits((1, 3.0))])
    ours = TokenTrace([1], [_logits((1, 3.5))])
    expected = float(
        torch.log_softmax(_logits((1, 3.5)), -1)[1] - torch.log_softmax(_logits((1, 3.0)), -1)[1]
    )
    assert max_logprob_delta(ours, reference) == abs(expected)


@pytest.mark.parametrize(
    ("value", "dtype", "spacing"),
    [
        (16.0, torch.bfloat16, 0.125),
        (31.875, torch.bfloat16, 0.125),
        (32.0, torch.bfloat16, 0.25),
        (-40.5, torch.bfloat16, 0.25),
        (1.0, torch.float16, 2**-10),
        (1.0, torch.float32, 2**-23),
        (28.0, torch.float32, 2**-19),
    ],
)
def test_an_ulp_is_the_grid_spacing_of_the_dtype_in_the_values_binade(
    value: float, dtype: torch.dtype, spacing: float
) -> None:
    assert ulp(value, dtype) == spacing
    # The grid really has that spacing there: the next representable number up.
    above = torch.nextafter(torch.tensor(abs(value), dtype=dtype), torch.tensor(99.0, dtype=dtype))
    assert float(above) - abs(value) == spacing


def _bf16_divergence(top1: float, margin: float) -> tuple[TokenTrace, TokenTrace]:
    """The reference picks 5 with ``top1``, 6 trails by ``margin``; we picked 6."""
    reference = TokenTrace([5], [_logits((5, top1), (6, top1 - margin))])
    ours = TokenTrace([6], [_logits((5, top1 - margin), (6, top1))])
    return reference, ours


@pytest.mark.parametrize("top1", [20.0, 40.0, 80.0])
def test_a_bf16_divergence_is_a_tie_up_to_k_ulps_of_the_top1_logit_in_every_binade(
    top1: float,
) -> None:
    rule = tie_rule(torch.bfloat16)
    spacing = ulp(top1, torch.bfloat16)
    reference, ours = _bf16_divergence(top1, rule.max_ulps * spacing)
    at_k = check_batch("a", ours, reference, rule)
    assert at_k.passed and at_k.tie, at_k.detail
    assert at_k.margin_ulps == rule.max_ulps
    reference, ours = _bf16_divergence(top1, (rule.max_ulps + 1) * spacing)
    beyond = check_batch("a", ours, reference, rule)
    assert not beyond.passed
    assert beyond.margin_ulps == rule.max_ulps + 1


def test_the_issues_quarter_margin_is_one_ulp_in_32_to_64_and_a_tie_reported_in_ulps() -> None:
    reference, ours = _bf16_divergence(40.0, 0.25)
    outcome = check_batch("r09", ours, reference, tie_rule(torch.bfloat16))
    assert outcome.passed and outcome.tie
    assert outcome.detail == (
        "tie at r09: step 0: paged token 6 != generate token 5, reference top-2 margin 0.25 "
        "= 1 ulp of its top-1 logit 40 in bfloat16 (<= 8)"
    )


def test_an_exact_tie_is_zero_ulps() -> None:
    assert margin_in_ulps(_logits((5, 33.0), (6, 33.0)), torch.bfloat16) == 0.0


def test_float32_keeps_a_tolerance_of_about_1e3_for_logits_in_16_to_32() -> None:
    assert TIE_ULPS[torch.float32] * ulp(28.0, torch.float32) == pytest.approx(1e-3, rel=0.03)


def test_a_dtype_without_a_tie_rule_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"no tie rule for dtype torch\.float64"):
        tie_rule(torch.float64)


def test_the_tie_rule_describes_itself_in_ulps() -> None:
    assert TieRule(torch.bfloat16, 8).describe() == (
        "top-2 margin <= 8 ulp of the top-1 logit in bfloat16"
    )
