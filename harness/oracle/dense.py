"""The dense reference: HF ``model.generate`` with its own dense cache, greedy.

A continuation of a request with several (``--n``) is ``generate`` with its first token
forced by a ``LogitsProcessor``: the same prefill and the same one-token decodes the
engine runs for it, so it can be compared bit for bit.

Two pitfalls met on the way, both handled here:
- always pass an explicit ``attention_mask``: SmolLM2's pad token is its EOS, which also
  appears inside chat prompts, and without a mask ``generate`` masks those prompt tokens
  out and the output changes;
- ``generate`` casts the next-token logits to float32 before its argmax; the engine does
  the same, and the logits returned here are those float32 rows.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from harness.runtime.sampling import continuation_first_tokens


@dataclass(frozen=True, slots=True)
class DenseOutput:
    """Greedy tokens from ``generate`` and the float32 logits each was chosen from."""

    token_ids: list[int]
    logits: list[torch.Tensor]  # each [vocab] float32
    elapsed_s: float


def generate_dense(
    model: Any,  # Any: a transformers causal LM
    prompt_ids: tuple[int, ...],
    max_new_tokens: int,
    eos_token_id: int | None,
) -> DenseOutput:
    """One request through ``generate(do_sample=False)``; stops at EOS like the engine."""
    return _generate(model, prompt_ids, max_new_tokens, eos_token_id, LogitsProcessorList())


def generate_dense_continuation(
    model: Any,  # Any: a transformers causal LM
    prompt_ids: tuple[int, ...],
    max_new_tokens: int,
    eos_token_id: int | None,
    *,
    rank: int,
    num_continuations: int,
) -> DenseOutput:
    """Continuation ``rank`` of ``num_continuations``: ``generate`` forced to that first token.

    The first token is chosen from ``generate``'s own prefill logits by the engine's rule
    (``continuation_first_tokens``), then decoding is greedy. The returned logits are the
    raw ones (``output_logits``), so step 0's are the prefill's, not the forced ones.
    """
    force = ForceFirstToken(len(prompt_ids), rank, num_continuations)
    return _generate(model, prompt_ids, max_new_tokens, eos_token_id, LogitsProcessorList([force]))


class ForceFirstToken(LogitsProcessor):
    """Leave only continuation ``rank``'s first token possible at the first step."""

    def __init__(self, prompt_length: int, rank: int, num_continuations: int) -> None:
        self.prompt_length = prompt_length
        self.rank = rank
        self.num_continuations = num_continuations

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores``: ``[1, vocab]`` float32; a new tensor, so the raw logits stay as they are."""
        if input_ids.shape[1] != self.prompt_length:
            return scores
        # On the host, as the engine chooses: topk may order equal logits differently on
        # another device.
        token_id = continuation_first_tokens(scores[0].cpu(), self.num_continuations)[self.rank]
        forced = torch.full_like(scores, float("-inf"))
        forced[:, token_id] = 0.0
        return forced


def _generate(
    model: Any,  # Any: a transformers causal LM
    prompt_ids: tuple[int, ...],
    max_new_tokens: int,
    eos_token_id: int | None,
    processors: LogitsProcessorList,
) -> DenseOutput:
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.int64, device=device)
    started = time.perf_counter()
    with torch.no_grad():
        result = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=processors,
        )
    elapsed = time.perf_counter() - started
    token_ids = result.sequences[0, len(prompt_ids) :].tolist()
    # One transfer: the rows live on the host for the checks, as the engine's do.
    logits = list(torch.cat(result.logits).float().cpu())  # each [vocab] float32
    return DenseOutput(token_ids=token_ids, logits=logits, elapsed_s=elapsed)


def generate_dense_batch(
    model: Any,  # Any: a transformers causal LM
    prompts: list[tuple[int, ...]],
    max_new_tokens: int,
    pad_token_id: int,
) -> list[list[int]]:
    """A static batch through ``generate`` (left-padded, EOS ignored): tokens per prompt."""
    device = next(model.parameters()).device
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        sequences = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    return [[int(t) for t in row[width:]] for row in sequences]
