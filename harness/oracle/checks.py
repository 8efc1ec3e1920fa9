"""The oracle: three checks per request, each with the promise it can honestly keep.

1. ``check_gate`` (the allocator gate, bitwise): the same engine and schedule on the
   paged pool and on contiguous per-request buffers; every step's logits ``torch.equal``
   and the tokens equal. Only paging differs between the two runs.
2. ``check_alone`` (paged vs ``generate``, one request alone): logits ``torch.equal``
   and tokens equal.
3. ``check_batch`` (continuous batching vs ``generate``): tokens identical; or a
   divergence at a near-tie, reported as a tie. Batched matrix products sum in another
   order than M = 1 ones, so logits drift and near-ties may flip.

The tie rule is relative (``TieRule``): a divergence passes only where the reference's
top-1/top-2 margin is at most ``max_ulps`` ulps of the reference's top-1 logit in the
run's dtype, and each side's token is in the other's top 5. An absolute margin cannot
work for bf16: its logits sit on a grid whose spacing doubles every binade (0.125 for
|logit| in [16, 32), 0.25 in [32, 64)), so a fixed 0.25 is one ulp in one binade and
"exact ties only" in the one below. Margins are reported in ulps.

Why each ``TIE_ULPS`` value (the measurements are in ``docs/results.md``):
- bfloat16, 8 ulps. A flip needs the reference's top two logits to move toward each other
  by the margin. Measured on SmolLM2-135M bf16 on CPU (packed batching vs ``generate``,
  14 prompts x 64 tokens): each of the top two logits moved by up to 4 ulps of the top-1
  logit on requests that never diverged, so margins up to 2 x 4 = 8 ulps are within the
  drift this arithmetic makes. Six divergences sat at 1 ulp; one (r09) at exactly 8 ulps,
  at a top-1 logit of 7.8, where the grid is 4x finer than in [16, 32) where SmolLM2's
  top-1 logits usually are. The drift is about 0.3-0.5 in absolute terms whatever the
  logit, so a divergence at a lower top-1 logit could need more: k = 8 is the measured
  drift doubled, and this run sits on its edge.
- float16, 8 ulps: the same reasoning, unmeasured (no fp16 run of a real model has been
  made). Rounding drift scales with the format's own grid, so counted in that format's
  ulps it should be about the same as bf16's.
- float32, 512 ulps: today's absolute 1e-3 restated relative (2^-10 ≈ 0.98e-3 for a
  top-1 logit in [16, 32), where SmolLM2's usually are). Float32 drift is ~1e-5..1e-4,
  far below it; the SmolLM2 float32 run has no ties at all under either rule.

A failed check carries the request, the step, both tokens and the reference's margin.
"""

import math
from dataclasses import dataclass

import torch

TIE_ULPS = {torch.float32: 512, torch.bfloat16: 8, torch.float16: 8}
TOP_K_FOR_TIES = 5


@dataclass(frozen=True, slots=True)
class TieRule:
    """Check 3's near-tie: a reference top-2 margin of at most ``max_ulps`` ulps of the
    reference's top-1 logit, on ``dtype``'s grid (inclusive)."""

    dtype: torch.dtype
    max_ulps: int

    @property
    def dtype_name(self) -> str:
        """``bfloat16``, ``float32``, ...: the dtype as the command line spells it."""
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """The rule in one phrase, for the table and messages."""
        return f"top-2 margin <= {self.max_ulps} ulp of the top-1 logit in {self.dtype_name}"


def tie_rule(dtype: torch.dtype) -> TieRule:
    """The tie rule for a run whose model and K/V are ``dtype``."""
    if dtype not in TIE_ULPS:
        known = ", ".join(str(known).removeprefix("torch.") for known in TIE_ULPS)
        raise ValueError(f"no tie rule for dtype {dtype} (known: {known})")
    return TieRule(dtype, TIE_ULPS[dtype])


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s grid at ``|value|``: the gap from ``|value|``'s binade
    floor to the next number up (0.125 for bf16 in [16, 32), 0.25 in [32, 64))."""
    finfo = torch.finfo(dtype)
    if abs(value) < finfo.smallest_normal:
        return finfo.smallest_normal * finfo.eps  # the subnormal spacing
    # |value| = mantissa * 2**exponent, mantissa in [0.5, 1): the binade [2**(e-1), 2**e)
    # has spacing eps * 2**(e-1), eps being the spacing at 1.0.
    _, exponent = math.frexp(abs(value))
    return math.ldexp(finfo.eps, exponent - 1)


def margin_in_ulps(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The top-1/top-2 margin of ``logits`` ([vocab]) in ulps of its top-1 logit."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]) / ulp(float(top[0]), dtype)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check on one request: passed or not, how (``detail``), and where it broke.

    ``margin_ulps``: for a check 3 divergence (a tie or not), the reference's top-2 margin
    in ulps of its top-1 logit.
    """

    passed: bool
    detail: str
    tie: bool = False
    margin_ulps: float | None = None


@dataclass(frozen=True, slots=True)
class TokenTrace:
    """A request's tokens and the float32 logits each was chosen from (on the host)."""

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
    request_id: str, paged: TokenTrace, dense: TokenTrace, rule: TieRule
) -> CheckResult:
    """Check 3: continuous batching emits ``generate``'s tokens, or diverges at a near-tie."""
    for step, (ours, theirs) in enumerate(zip(paged.token_ids, dense.token_ids, strict=False)):
        if ours == theirs:
            continue
        ours_logits, theirs_logits = paged.logits[step], dense.logits[step]
        margin = top2_margin(theirs_logits)
        ulps = margin_in_ulps(theirs_logits, rule.dtype)
        in_top = ours in _top_k(theirs_logits) and theirs in _top_k(ours_logits)
        where = (
            f"{request_id}: step {step}: paged token {ours} != generate token {theirs}, "
            f"reference top-2 margin {margin:.3g} = {ulps:.3g} ulp of its top-1 logit "
            f"{float(theirs_logits.max()):.4g} in {rule.dtype_name}"
        )
        if ulps <= rule.max_ulps and in_top:
            detail = f"tie at {where} (<= {rule.max_ulps})"
            return CheckResult(True, detail, tie=True, margin_ulps=ulps)
        return CheckResult(False, where, margin_ulps=ulps)
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
