"""The three checks on hand-made logits: what passes, what is a tie, what fails and how."""

import torch

from harness.oracle.checks import (
    TokenTrace,
    check_alone,
    check_batch,
    check_gate,
    max_logprob_delta,
    top2_margin,
)


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
    outcome = check_batch("a", ours, reference, tie_margin=1e-3)
    assert outcome.passed and outcome.tie
    assert "step 1: paged token 6 != generate token 5" in outcome.detail


def test_a_divergence_with_a_clear_margin_fails_with_both_tokens_and_the_margin() -> None:
    reference = TokenTrace([5], [_logits((5, 2.0), (6, 1.0))])
    ours = TokenTrace([6], [_logits((5, 1.0), (6, 2.0))])
    outcome = check_batch("a", ours, reference, tie_margin=1e-3)
    assert not outcome.passed
    assert (
        outcome.detail == "a: step 0: paged token 6 != generate token 5, reference top-2 margin 1"
    )


def test_a_near_tie_outside_the_other_sides_top5_fails() -> None:
    reference = TokenTrace([5], [_logits((5, 2.0), (6, 1.9999))])
    # Our token 9 is not in the reference's top 5 (ties at 0.0 rank lower indices first).
    ours = TokenTrace([9], [_logits((9, 3.0))])
    assert not check_batch("a", ours, reference, tie_margin=1e-3).passed


def test_different_lengths_fail_check_3() -> None:
    reference = TokenTrace([5, 5], [_logits((5, 2.0))] * 2)
    ours = TokenTrace([5], [_logits((5, 2.0))])
    outcome = check_batch("a", ours, reference, tie_margin=1e-3)
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
