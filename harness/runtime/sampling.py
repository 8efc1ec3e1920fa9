"""Choosing tokens from logits: a seeded temperature and top-p draw, and the distinct first
tokens of several greedy continuations. Greedy choice itself is the engine's one
``argmax`` over a step."""

import torch

from harness.runtime.requests import SamplingParams


def continuation_first_tokens(logits: torch.Tensor, count: int) -> list[int]:
    """The first tokens of ``count`` continuations from one ``[vocab]`` row of logits.

    The argmax first (what greedy decoding picks), then the next best tokens in
    ``torch.topk``'s order, skipping the argmax should a tie put it elsewhere.
    """
    best = int(torch.argmax(logits))
    ranked = [int(i) for i in torch.topk(logits, count).indices if int(i) != best]
    return [best, *ranked[: count - 1]]


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """A token drawn from ``logits`` ([vocab], host) by temperature and top-p."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def logits_to_host(step_logits: list[torch.Tensor]) -> torch.Tensor:
    """The step's logits, every forward's rows in order, ``[rows, vocab]`` on the host.

    NOTE: the step's one device-to-host transfer and its one sync: greedy choice, sampling
    and the checks all read the host copy, so the device holds no logits between steps
    (one float32 row is 192 KiB for SmolLM2's 49,152-token vocabulary).
    """
    stacked = step_logits[0] if len(step_logits) == 1 else torch.cat(step_logits)
    return stacked.cpu()
