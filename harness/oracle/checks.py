"""The oracle: three checks per request, each with the promise it can honestly keep.

1. ``check_gate`` (the allocator gate, bitwise): the same engine and schedule on the
   paged pool and on contiguous per-request buffers; every step's logits ``torch.equal``
   and the tokens equal. Only paging differs between the two runs.
2. ``check_alone`` (paged vs ``generate``, one request alone): logits ``torch.equal``
   and tokens equal.
3. ``check_batch`` (continuous batching vs ``generate``): tokens identical; or a
   divergence where the reference's top-1/top-2 margin is below ``tie_margin`` and each
   side's token is in the other's top-5, reported as a tie. Batched matrix products sum
   in another order than M = 1 ones, so logits drift ~1e-4 and near-ties may flip.

A failed check carries the request, the step, both tokens and the reference's margin.
"""

from dataclasses import dataclass

import torch

# Top-1/top-2 logit margins below these count as near-ties for check 3. float32 is
# measured on CPU (drift ~1e-4); the bfloat16 value is a placeholder until calibrated on
# a GPU (scripts/gpu_check.sh).
TIE_MARGINS = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}
TOP_K_FOR_TIES = 5


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check on one request: passed or not, how (``detail``), and where it broke."""

    passed: bool
    detail: str
    tie: bool = False


@dataclass(frozen=True, slots=True)
class TokenTrace:
    """A request's tokens and the float32 logits each was chosen from."""

    token_ids: list[int]
    logits: list[torch.Tensor]  # each [vocab] float32


def top2_margin(logits: torch.Tensor) -> float:
    """How far the best logit is ahead of the second best."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check_gate(request_id: str, paged: TokenTrace, contiguous: TokenTrace) -> CheckResult:
    """Check 1: paged and contiguous runs of the same schedule are bit-identical."""
    return _check_identical(request_id, paged, contiguous, "contiguous")


def check_alone(request_id: str, paged: TokenTrace, dense: TokenTrace) -> CheckResult:
    """Check 2: a request run alone on the pool is bit-identical to ``generate``."""
    return _check_identical(request_id, paged, dense, "generate")


def check_batch(
    request_id: str, paged: TokenTrace, dense: TokenTrace, tie_margin: float
) -> CheckResult:
    """Check 3: continuous batching emits ``generate``'s tokens, or diverges at a near-tie."""
    for step, (ours, theirs) in enumerate(zip(paged.token_ids, dense.token_ids, strict=False)):
        if ours == theirs:
            continue
        ours_logits, theirs_logits = paged.logits[step], dense.logits[step]
        margin = top2_margin(theirs_logits)
        in_top = ours in _top_k(theirs_logits) and theirs in _top_k(ours_logits)
        where = (
            f"{request_id}: step {step}: paged token {ours} != generate token {theirs}, "
            f"reference top-2 margin {margin:.3g}"
        )
        if margin < tie_margin and in_top:
            return CheckResult(True, f"tie at {where} (< {tie_margin:g})", tie=True)
        return CheckResult(False, where)
    if len(paged.token_ids) != len(dense.token_ids):
        return CheckResult(
            False,
            f"{request_id}: {len(paged.token_ids)} tokens vs generate's {len(dense.token_ids)}",
        )
    return CheckResult(True, "tokens identical")


def max_logprob_delta(paged: TokenTrace, dense: TokenTrace) -> float:
    """Max |log p_paged - log p_generate| of the chosen tokens, up to the first divergence."""
    worst = 0.0
    for step, (ours, theirs) in enumerate(zip(paged.token_ids, dense.token_ids, strict=False)):
        ours_logprob = torch.log_softmax(paged.logits[step], dim=-1)[theirs]
        theirs_logprob = torch.log_softmax(dense.logits[step], dim=-1)[theirs]
        worst = max(worst, abs(float(ours_logprob - theirs_logprob)))
        if ours != theirs:
            break
    return worst


def _top_k(logits: torch.Tensor) -> set[int]:
    return {int(i) for i in torch.topk(logits, TOP_K_FOR_TIES).indices}


def _check_identical(
    request_id: str, ours: TokenTrace, theirs: TokenTrace, their_name: str
) -> CheckResult:
    for step, (our_logits, their_logits) in enumerate(
        zip(ours.logits, theirs.logits, strict=False)
    ):
        if not torch.equal(our_logits, their_logits):
            our_token, their_token = ours.token_ids[step], theirs.token_ids[step]
            difference = float((our_logits - their_logits).abs().nan_to_num(float("inf")).max())
            return CheckResult(
                False,
                f"{request_id}: step {step}: logits differ (max |diff| {difference:.3g}); "
                f"paged token {our_token} vs {their_name} token {their_token}, "
                f"reference top-2 margin {top2_margin(their_logits):.3g}",
            )
    if ours.token_ids != theirs.token_ids:
        return CheckResult(
            False,
            f"{request_id}: {len(ours.token_ids)} tokens vs {their_name}'s {len(theirs.token_ids)}",
        )
    return CheckResult(True, "bit-identical")
