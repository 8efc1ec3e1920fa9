"""What the harness knows of hybrid models: which layers hold a recurrent state, which
module of such a layer mixes tokens (the one the paged state wrapper replaces), and the
shapes of its state.

A hybrid (LFM2: short convolution beside attention; Qwen3-Next and Qwen3.5, dense and MoE:
gated DeltaNet beside attention; Bamba, Granite 4.0 and Nemotron-H: Mamba-2 beside
attention; Falcon-H1: Mamba-2 and attention side by side in every layer) has layers whose
per-request state is a fixed-size tensor, not a K/V that grows by token. transformers 5.23
keeps it in ``LinearAttentionLayer`` (``conv_states``, ``recurrent_states``); a recurrent
state stays float32 in a bf16 model, so the shapes are read, dtype and all, from a
one-token forward into HF's own ``DynamicCache``.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from harness.kv_layout import StateShape
from spec import GroupKind, RecurrentState

# The layer types (HF's ``layer_types``) that hold a recurrent state.
STATE_LAYER_TYPES = frozenset({"conv", "linear_attention", "hybrid"})
# Of those, the layer types that attend too (Falcon-H1's "hybrid": attention and Mamba-2
# side by side in one layer).
ATTENDING_STATE_LAYER_TYPES = frozenset({"hybrid"})


@dataclass(frozen=True, slots=True)
class StateMixer:
    """Where a model type's state mixer sits: the decoder layer's attribute holding it,
    and the keyword it takes its cache as."""

    attribute: str
    cache_keyword: str


# The hybrids whose state mixer the wrapper (``harness.runtime.state_mixer``) runs per
# request, by ``config.model_type``: their mixers read and write the state only through
# HF's cache calls, which the wrapper points at the request's state rows.
STATE_MIXERS: dict[str, StateMixer] = {
    "lfm2": StateMixer("conv", "past_key_values"),
    "qwen3_next": StateMixer("linear_attn", "cache_params"),
    "qwen3_5_text": StateMixer("linear_attn", "cache_params"),
    "qwen3_5_moe_text": StateMixer("linear_attn", "cache_params"),
    "bamba": StateMixer("mamba", "cache_params"),
    "granitemoehybrid": StateMixer("mamba", "cache_params"),
    "nemotron_h": StateMixer("mixer", "cache_params"),
    "falcon_h1": StateMixer("mamba", "cache_params"),  # beside the layer's attention
}

# The checkpoint interval C a run takes unless told (tokens; rounded up to a multiple of
# the block size): on the built-in prompts it gave the most prefix hit tokens and the
# fewest prefill forwards of 16, 32 and 64 (docs/results.md "Hybrid models"), and 64 is
# the chunk of transformers' torch gated-delta-rule kernel, whose chunks a prefill from a
# checkpoint on that grid lines up with.
DEFAULT_CHECKPOINT_INTERVAL = 64


def checkpoint_interval_of(group_windows: Sequence[GroupKind]) -> int:
    """The checkpoint interval of the state group among ``group_windows`` (the default
    without one)."""
    intervals = [kind.interval for kind in group_windows if isinstance(kind, RecurrentState)]
    return intervals[0] if intervals else DEFAULT_CHECKPOINT_INTERVAL


def state_layers(config: Any) -> tuple[int, ...]:  # Any: a transformers config
    """The indices of the layers of ``config`` that hold a recurrent state."""
    layer_types = getattr(config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(layer_types) if kind in STATE_LAYER_TYPES)


def attending_state_layers(config: Any) -> tuple[int, ...]:  # Any: a transformers config
    """The indices of the state layers of ``config`` that attend too."""
    layer_types = getattr(config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(layer_types) if kind in ATTENDING_STATE_LAYER_TYPES)


def state_mixer(model: Any) -> StateMixer | None:  # Any: a transformers PreTrainedModel
    """The state mixer of ``model``'s type, or ``None`` for a type the harness has none of."""
    return STATE_MIXERS.get(model.config.model_type)


def default_interval(block_size: int) -> int:
    """The checkpoint interval for ``block_size``: the least multiple of the block size at
    least ``DEFAULT_CHECKPOINT_INTERVAL``."""
    return -(-DEFAULT_CHECKPOINT_INTERVAL // block_size) * block_size


def state_shapes(model: Any) -> tuple[StateShape, ...]:  # Any: a transformers PreTrainedModel
    """Each state layer's state shape and dtype, read from one token's forward through HF's
    ``DynamicCache`` (the model's own dtype and device)."""
    layers = state_layers(model.config)
    if not layers:
        return ()
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device),
            past_key_values=cache,
            use_cache=True,
        )
    shapes = []
    for layer_idx in layers:
        layer = cache.layers[layer_idx]
        assert isinstance(layer, LinearAttentionCacheLayerMixin), f"layer {layer_idx} state"
        conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        assert conv is not None, f"layer {layer_idx} wrote no conv state"
        shapes.append(
            StateShape(
                conv_shape=tuple(conv.shape[1:]),
                conv_dtype=conv.dtype,
                recurrent_shape=None if recurrent is None else tuple(recurrent.shape[1:]),
                recurrent_dtype=None if recurrent is None else recurrent.dtype,
            )
        )
    return tuple(shapes)
