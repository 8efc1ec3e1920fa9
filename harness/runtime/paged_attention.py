"""The HF hook: an attention function that writes to and reads from a ``KVStore``.

It is registered with ``transformers.AttentionInterface`` under ``"pagedkv"``. One forward
packs several requests (prefills and decodes mixed) as ``input_ids [1, T]`` with explicit
``position_ids``; the per-step ``StepMetadata`` travels as the model kwarg
``pagedkv_step`` down to every attention layer. In each layer the function writes the
step's new K/V rows to the store (all requests at once), reads back each request's tokens,
and runs SDPA on each request alone: the same call, on the same values, that HF's dense
cache makes for a single request (through transformers' own wrapper, or for a one-query
decode directly with the wrapper's arguments). That is what makes paged vs contiguous (and
paged vs ``generate`` for one request) bit-identical, and it is why a NaN-poisoned freed
block can only show up if a request really reads it (no padded read, no ``0 * NaN``).

The model's own mask building costs nothing: ``"pagedkv"`` has no entry in
``AttentionMaskInterface``, so ``create_causal_mask`` returns None at once. Causality, per
request, with ``n`` queries over ``token_count`` keys:
- a whole prefill (``n == token_count``): no mask, HF's wrapper sets SDPA's ``is_causal``,
  exactly as ``generate``'s prefill does;
- a decode or a one-token prefill tail (``n == 1``): no mask, the query attends to all keys;
- a partial prefill (``1 < n < token_count``, after a prefix-cache hit or on recompute
  after preemption): an explicit boolean mask ``[1, 1, n, token_count]`` aligned to the
  bottom right, query ``i`` attending keys ``0 .. token_count - n + i``. SDPA's own
  ``is_causal`` is aligned top-left, which would be wrong here, and HF's wrapper turns it
  off whenever a mask is given. A mask also changes SDPA's kernel path (GQA by repeated
  heads), so a partial prefill is not bit-identical to a whole one.

A kernel backend (``--attention``, ``harness.runtime.attention_backends``) takes over after
the write: when the step carries a ``KernelStep``, one kernel call per layer reads the
store's pages in place for the whole step, and gather runs only to measure the kernel's
agreement when asked.

It is *not* a ``Cache``: the model runs with ``use_cache=False`` and keeps no K/V itself.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa

from harness.models import UnsupportedModelError
from harness.runtime.attention_backends import KernelStep, default_scale
from harness.runtime.kv_pool import KVPlan, KVStore

ATTENTION_NAME = "pagedkv"
STEP_KWARG = "pagedkv_step"


@dataclass(frozen=True, slots=True)
class RequestSlice:
    """One request's part of a packed step: its query rows ``[query_start, query_end)``.

    ``mask`` is the partial-prefill mask (``partial_prefill_mask``), ``None`` otherwise.
    """

    query_start: int
    query_end: int
    mask: torch.Tensor | None = None  # [1, 1, query_count, token_count] bool, True = attend


def partial_prefill_mask(
    query_count: int, token_count: int, device: torch.device
) -> torch.Tensor | None:
    """The causal mask for the last ``query_count`` of ``token_count`` tokens, or ``None``.

    ``None`` when no mask is needed: a whole prefill (SDPA's ``is_causal``) or one query.
    """
    if query_count <= 1 or query_count == token_count:
        return None
    # allowed[i, j]: query i sits at position token_count - query_count + i and sees key j <= it
    allowed = torch.ones(query_count, token_count, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=token_count - query_count)[None, None]


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything attention needs for one forward: the store, its plan, each request's slice.

    ``slices[i]`` is the request ``plan.request_ids[i]``; ``kernel``: the kernel backend's
    call for the step, ``None`` for gather.
    """

    store: KVStore
    plan: KVPlan
    slices: tuple[RequestSlice, ...]
    kernel: KernelStep | None = None


def paged_attention_forward(
    # Any: the transformers attention module (has layer_idx, num_key_value_groups).
    module: Any,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    # Any: transformers passes its own kwargs through (position_ids, use_cache, ...).
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the store for every request of the step; returns ``[1, T, heads, dim]``."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepMetadata):
        raise TypeError(f"the {ATTENTION_NAME!r} attention needs a {STEP_KWARG}= StepMetadata")
    plan = step.plan
    check_attention_kwargs(attention_mask, dropout, kwargs, max(plan.token_counts))
    layer_idx: int = module.layer_idx
    # The step's new K/V rows, [step_tokens, num_kv_heads, head_dim], all written before
    # any request reads: a request reading a prefix block that another request of the
    # same step fills sees it filled.
    step.store.write(layer_idx, plan, key[0].transpose(0, 1), value[0].transpose(0, 1))
    kernel = step.kernel
    if kernel is None:
        return _gather_attention(module, query, key, value, step=step, scaling=scaling), None
    # [T, num_heads, head_dim] in and out; the seam hands the kernel the packed step.
    scale = default_scale(query.shape[-1]) if scaling is None else scaling
    output = kernel.attend(layer_idx, query[0].transpose(0, 1), scale).unsqueeze(0)
    if kernel.agreement is not None:
        gather = _gather_attention(module, query, key, value, step=step, scaling=scaling)
        kernel.agreement.record(layer_idx, output, gather)
    return output, None


def _gather_attention(
    module: Any,  # Any: the transformers attention module
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    *,
    step: StepMetadata,
    scaling: float | None,
) -> torch.Tensor:
    """Each request's K/V read from the store and one SDPA per request; ``[1, T, heads, dim]``."""
    plan = step.plan
    layer_idx: int = module.layer_idx
    one_query_gqa = _one_query_gqa(module, key, value)
    outputs = []
    for index, (part, (keys, values)) in enumerate(
        zip(step.slices, step.store.read(layer_idx, plan), strict=True)
    ):
        start, end = part.query_start, part.query_end
        if part.mask is None and 1 < end - start < plan.token_counts[index]:
            # Our own bug if reached: SDPA's causal mask is top-left aligned, so a partial
            # prefill without the bottom-right mask would hide most of each query's past.
            raise AssertionError(f"partial prefill of {plan.request_ids[index]!r} without a mask")
        # keys, values: [1, num_kv_heads, token_count, head_dim], strided views
        # output: [1, new_tokens, num_heads, head_dim]
        if end - start == 1 and one_query_gqa is not None:
            # NOTE: the call HF's wrapper makes for one query without a mask, made directly:
            # the wrapper's dispatch costs ~5 us a call (29.6 vs 34.9 us, SmolLM2 shapes, one
            # CPU thread), 240 calls in a batch-8 decode step.
            output = scaled_dot_product_attention(
                query[:, :, start:end, :], keys, values, scale=scaling, enable_gqa=one_query_gqa
            ).transpose(1, 2)
        else:
            output, _ = sdpa_attention_forward(
                module,
                query[:, :, start:end, :],
                keys,
                values,
                part.mask,
                dropout=0.0,
                scaling=scaling,
            )
        outputs.append(output)
    if len(outputs) == 1:
        return outputs[0].contiguous()
    return torch.cat(outputs, dim=1)


def check_attention_kwargs(
    attention_mask: torch.Tensor | None,
    dropout: float,
    # Any: the attention kwargs transformers passed through.
    kwargs: dict[str, Any],
    longest: int,
) -> None:
    """Raise ``UnsupportedModelError`` for an attention argument this function would drop.

    The second line of defence behind ``harness.models.check_supported``: a model that got
    past it but still asks for a mask, dropout, softcapping, sinks, a position bias,
    non-causal attention, or a sliding window narrower than the longest request here.
    """
    refusals = []
    if attention_mask is not None:
        refusals.append("an attention_mask (the hook builds each request's causal mask)")
    if dropout != 0.0:
        refusals.append(f"dropout={dropout}")
    for name in ("softcap", "s_aux", "position_bias"):
        value = kwargs.get(name)
        if value is not None:
            refusals.append(name if isinstance(value, torch.Tensor) else f"{name}={value}")
    if kwargs.get("is_causal") is False:
        refusals.append("is_causal=False")
    window = kwargs.get("sliding_window")
    if window is not None and longest > window:
        refusals.append(f"sliding_window={window} under a request of {longest} tokens")
    if refusals:
        raise UnsupportedModelError(
            f"the {ATTENTION_NAME!r} attention does not implement: " + ", ".join(refusals)
        )


def _one_query_gqa(
    module: Any,  # Any: the transformers attention module
    key: torch.Tensor,
    value: torch.Tensor,
) -> bool | None:
    """``enable_gqa`` as HF's SDPA wrapper sets it for one query and no mask, or ``None``.

    ``None`` when the wrapper would take another path (it packs the query's heads instead
    of asking SDPA for GQA on some devices); such calls keep going through the wrapper.
    """
    if module.num_key_value_groups == 1:
        return False
    return True if use_gqa_in_sdpa(None, key, value) else None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def using_paged_attention(model: Any) -> Iterator[None]:  # Any: a transformers PreTrainedModel
    """Switch ``model`` to the paged attention for the block, and back to what it had after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def forward_step(
    model: Any,  # Any: a transformers causal LM
    input_ids: torch.Tensor,  # [1, T]
    position_ids: torch.Tensor,  # [1, T]
    step: StepMetadata,
    logits_rows: torch.Tensor,  # [num_requests] positions in T whose logits are wanted
) -> torch.Tensor:
    """One packed forward through the store; float32 logits ``[num_requests, vocab]``."""
    output = model(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=logits_rows,
        **{STEP_KWARG: step},
    )
    # generate() casts the next-token logits to float32 before choosing; so do we.
    logits: torch.Tensor = output.logits[0].float()
    return logits
