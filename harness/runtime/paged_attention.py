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

A model whose dense reference runs eager attention (Gemma 2: no SDPA, softcapping) runs
under ``"pagedkv_eager"``: the same function, each request through the model module's own
``eager_attention_forward`` with the additive mask eager gets. A layer with a sliding
window reads only the keys the dense cache hands it (``visible_start``) and gets the mask
HF gives it (``allowed_keys``, ``sliding_window_mask``); with KV cache groups each layer
reads through its group's table, whose first blocks the window may have released.

A kernel backend (``--attention``, ``harness.runtime.attention_backends``) takes over after
the write: when the step carries a ``KernelStep``, one kernel call per layer reads the
store's pages in place for the whole step, and gather runs only to measure the kernel's
agreement when asked.

It is *not* a ``Cache``: the model runs with ``use_cache=False`` and keeps no K/V itself.
"""

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa

from harness.models import UnsupportedModelError
from harness.runtime.attention_backends import default_scale
from harness.runtime.step_batch import StepMetadata
from spec import first_window_token

ATTENTION_NAME = "pagedkv"
EAGER_ATTENTION_NAME = "pagedkv_eager"
STEP_KWARG = "pagedkv_step"


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
    implementation: str = "sdpa",
    # Any: transformers passes its own kwargs through (position_ids, softcap, ...).
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the store for every request of the step, each computed as the dense
    reference computes it: by SDPA, or (``implementation="eager"``, registered as
    ``"pagedkv_eager"``) by the model's own eager function; returns ``[1, T, heads, dim]``."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepMetadata):
        raise TypeError(f"the {ATTENTION_NAME!r} attention needs a {STEP_KWARG}= StepMetadata")
    plan = step.plan
    check_attention_kwargs(
        attention_mask,
        dropout,
        {"is_causal": getattr(module, "is_causal", True), **kwargs},
        implementation,
    )
    layer_idx: int = module.layer_idx
    # The step's new K/V rows, [step_tokens, num_kv_heads, head_dim], all written before
    # any request reads: a request reading a prefix block that another request of the
    # same step fills sees it filled.
    step.store.write(layer_idx, plan, key[0].transpose(0, 1), value[0].transpose(0, 1))
    kernel = step.kernel
    if kernel is None:
        return _gather_attention(
            module, query, step, scaling=scaling, implementation=implementation, kwargs=kwargs
        ), None
    # [T, num_heads, head_dim] in and out; the seam hands the kernel the packed step.
    scale = default_scale(query.shape[-1]) if scaling is None else scaling
    output = kernel.attend(layer_idx, query[0].transpose(0, 1), scale).unsqueeze(0)
    if kernel.agreement is not None:
        gather = _gather_attention(
            module, query, step, scaling=scaling, implementation=implementation, kwargs=kwargs
        )
        kernel.agreement.record(layer_idx, output, gather)
    return output, None


def _gather_attention(
    module: Any,  # Any: the transformers attention module
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    step: StepMetadata,
    *,
    scaling: float | None,
    implementation: str,
    # Any: the attention kwargs transformers passed through (sliding_window, softcap).
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Each request's K/V read from the store and its attention computed alone, as the
    dense reference computes it; ``[1, T, heads, dim]``."""
    plan = step.plan
    layer_idx: int = module.layer_idx
    window: int | None = kwargs.get("sliding_window")
    outputs = []
    # Where each request's rows begin: past the blocks a sliding window skipped.
    first_held = step.store.first_positions(layer_idx, plan)
    for index, (part, (keys, values)) in enumerate(
        zip(step.slices, step.store.read(layer_idx, plan), strict=True)
    ):
        start, end = part.query_start, part.query_end
        token_count = plan.token_counts[index]
        if part.mask is None and 1 < end - start < token_count:
            # Our own bug if reached: SDPA's causal mask is top-left aligned, so a partial
            # prefill without the bottom-right mask would hide most of each query's past.
            raise AssertionError(f"partial prefill of {plan.request_ids[index]!r} without a mask")
        # The keys the dense cache hands attention: all of a prefill's, a decode's last
        # ``window`` (HF's sliding-window cache layer keeps no more).
        first_key = visible_start(end - start, token_count, window)
        if first_key < first_held[index]:
            # Our own bug if reached: the allocator released a block this layer still reads
            # (its group's window is not the layer's).
            raise AssertionError(
                f"layer {layer_idx} of {plan.request_ids[index]!r} reads position {first_key}, "
                f"but its table starts at {first_held[index]}"
            )
        skip = first_key - first_held[index]
        # keys, values: [1, num_kv_heads, token_count - first_key, head_dim], strided views
        # output: [1, new_tokens, num_heads, head_dim]
        request = _RequestAttention(
            query[:, :, start:end, :],
            keys[:, :, skip:],
            values[:, :, skip:],
            token_count,
            first_key,
        )
        if implementation == "eager":
            output = _eager_request(module, request, window, scaling, kwargs.get("softcap"))
        else:
            mask = part.mask if window is None else sliding_window_mask(request, window)
            output = _sdpa_request(module, request, mask, scaling)
        outputs.append(output)
    if len(outputs) == 1:
        return outputs[0].contiguous()
    return torch.cat(outputs, dim=1)


@dataclass(frozen=True, slots=True)
class _RequestAttention:
    """One request's queries and the keys attention reads for them in one layer.

    The queries sit at positions ``token_count - query_count .. token_count - 1``, the keys
    at ``first_key .. token_count - 1``.
    """

    query: torch.Tensor  # [1, num_heads, query_count, head_dim]
    keys: torch.Tensor  # [1, num_kv_heads, token_count - first_key, head_dim]
    values: torch.Tensor  # [1, num_kv_heads, token_count - first_key, head_dim]
    token_count: int
    first_key: int

    @property
    def query_count(self) -> int:
        """How many queries (new tokens) the request has in this forward."""
        return int(self.query.shape[2])


def visible_start(query_count: int, token_count: int, window: int | None) -> int:
    """The position of the first key the queries of a forward read.

    With a window W the query at position q reads keys q - W + 1 .. q (transformers'
    ``kv_idx > q_idx - sliding_window``), so the first query, at
    ``token_count - query_count``, needs keys from ``token_count - query_count - W + 1``.
    For a decode that is the last W keys, what ``DynamicSlidingWindowLayer`` returns; a
    whole prefill reads every key, as ``generate``'s prefill does.
    """
    return first_window_token(token_count - query_count, window)


def allowed_keys(request: _RequestAttention, window: int | None) -> torch.Tensor:
    """``[1, 1, query_count, key_count]`` bool, True where a query reads a key: causal,
    aligned bottom-right, and within ``window`` when given (HF's sliding-window mask)."""
    device = request.query.device
    query_positions = torch.arange(
        request.token_count - request.query_count, request.token_count, device=device
    )[:, None]
    key_positions = torch.arange(request.first_key, request.token_count, device=device)[None, :]
    allowed = key_positions <= query_positions
    if window is not None:
        allowed &= key_positions > query_positions - window
    return allowed[None, None]


def sliding_window_mask(request: _RequestAttention, window: int) -> torch.Tensor | None:
    """The mask HF's SDPA path gives a sliding layer, or ``None`` where it gives none.

    transformers' ``_ignore_causal_mask_sdpa`` drops the mask (leaving SDPA's
    ``is_causal``, or nothing for one query) only while fewer than ``window`` keys are
    read and the queries are a whole prefill or one token; a mask changes SDPA's kernel
    path, so matching when it is given keeps the result bitwise.
    """
    key_count = request.token_count - request.first_key
    whole_or_one = request.query_count in (1, request.token_count)
    if key_count < window and whole_or_one:
        return None
    return allowed_keys(request, window)


def _sdpa_request(
    module: Any,  # Any: the transformers attention module
    request: _RequestAttention,
    mask: torch.Tensor | None,  # [1, 1, query_count, key_count] bool
    scaling: float | None,
) -> torch.Tensor:
    """One request's attention by SDPA, as HF's wrapper calls it: ``[1, n, heads, dim]``."""
    one_query_gqa = _one_query_gqa(module, request.keys, request.values)
    if request.query_count == 1 and mask is None and one_query_gqa is not None:
        # NOTE: the call HF's wrapper makes for one query without a mask, made directly:
        # the wrapper's dispatch costs ~5 us a call (29.6 vs 34.9 us, SmolLM2 shapes, one
        # CPU thread), 240 calls in a batch-8 decode step.
        return scaled_dot_product_attention(
            request.query, request.keys, request.values, scale=scaling, enable_gqa=one_query_gqa
        ).transpose(1, 2)
    output: torch.Tensor
    output, _ = sdpa_attention_forward(
        module, request.query, request.keys, request.values, mask, dropout=0.0, scaling=scaling
    )
    return output


def _eager_request(
    module: Any,  # Any: the transformers attention module
    request: _RequestAttention,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """One request's attention by the model's own eager function, with the additive mask
    HF's ``eager_mask`` builds (0 where allowed, the dtype's minimum elsewhere; always
    given, eager never drops it): ``[1, n, heads, dim]``.

    The keys are made contiguous as the dense cache's are (``torch.cat``): eager's
    ``matmul`` may sum in another order on a strided view.
    """
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"the {EAGER_ATTENTION_NAME!r} attention found no eager_attention_forward in "
            f"{type(module).__module__}"
        )
    dtype = request.query.dtype
    mask = torch.where(
        allowed_keys(request, window),
        torch.tensor(0.0, dtype=dtype, device=request.query.device),
        torch.finfo(dtype).min,
    )
    softcap_kwargs = {} if softcap is None else {"softcap": softcap}
    output: torch.Tensor
    output, _ = eager(
        module,
        request.query,
        request.keys.contiguous(),
        request.values.contiguous(),
        mask,
        dropout=0.0,
        scaling=scaling,
        **softcap_kwargs,
    )
    return output


def check_attention_kwargs(
    attention_mask: torch.Tensor | None,
    dropout: float,
    # Any: the attention kwargs transformers passed through.
    kwargs: dict[str, Any],
    implementation: str,
) -> None:
    """Raise ``UnsupportedModelError`` for an attention argument this function would drop.

    The second line of defence behind ``harness.models.check_supported``: a model that got
    past it but still asks for a mask, dropout, softcapping under SDPA (only the eager
    function applies it), sinks, a position bias or non-causal attention.
    """
    refusals = []
    if attention_mask is not None:
        refusals.append("an attention_mask (the hook builds each request's causal mask)")
    if dropout != 0.0:
        refusals.append(f"dropout={dropout}")
    dropped = (
        ("s_aux", "position_bias")
        if implementation == "eager"
        else ("softcap", "s_aux", "position_bias")
    )
    for name in dropped:
        value = kwargs.get(name)
        if value is not None:
            refusals.append(name if isinstance(value, torch.Tensor) else f"{name}={value}")
    if kwargs.get("is_causal") is False:
        refusals.append("is_causal=False")
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
AttentionInterface.register(
    EAGER_ATTENTION_NAME, functools.partial(paged_attention_forward, implementation="eager")
)
# The paged attention that mirrors each implementation the dense reference may run.
PAGED_ATTENTION = {"sdpa": ATTENTION_NAME, "eager": EAGER_ATTENTION_NAME}


@contextmanager
def using_paged_attention(model: Any) -> Iterator[None]:  # Any: a transformers PreTrainedModel
    """Switch ``model`` to the paged attention that mirrors its own (SDPA or eager) for the
    block, and back to what it had after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(PAGED_ATTENTION[previous])
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
