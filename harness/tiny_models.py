"""Tiny seeded random-weight models, one per architecture the harness supports: what the
tests and the CPU smoke runs use instead of a model no hub can serve here.
"""

from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from harness.models import LoadedModel, dense_attention

# The architectures the harness is tested on, as tiny seeded random-weight models: each
# a config class, its model class and what it needs beyond the shared shape. Each brings
# one feature the hook must carry: Qwen2 biases on q/k/v, Qwen3 q/k norms (and a head_dim
# of its own), Phi-3 a fused qkv projection, Mistral a sliding window on every layer,
# Gemma 2 sliding and full layers in turn with attention and final logit softcapping and
# query_pre_attn_scalar (eager attention), Gemma 3 sliding and full layers with a rope of
# their own each and q/k norms. The windows (7, 8, 6 tokens) are narrower than the test
# prompts, and 7 and 6 are no multiple of the tests' 4-token blocks. Any: transformers'
# config and model classes, untyped at this boundary.
TINY_ARCHITECTURES: dict[str, tuple[type[Any], type[Any], dict[str, object]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 7}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "sliding_window": 6,
            # Gemma 3's 5:1 pattern cut to two layers: one of each type.
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def tiny_model(architecture: str, seed: int) -> LoadedModel:
    """A seeded random-weight model of ``architecture`` (a key of ``TINY_ARCHITECTURES``),
    small enough for fast CPU tests (no tokenizer: feed ids).

    Two KV heads under four query heads, so grouped-query attention is exercised as in
    SmolLM2 (nine query heads over three KV heads).
    """
    config_class, model_class, extra = TINY_ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    # NOTE: default init gives near-uniform logits, where argmax ties are common; a wider
    # spread makes greedy tokens depend on every K/V value, which the tests rely on.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.25)
    model.eval()
    model.set_attn_implementation(dense_attention(model_class))
    return LoadedModel(model=model, tokenizer=None, name=f"tiny-{architecture}(seed={seed})")


def tiny_llama(seed: int) -> LoadedModel:
    """The tiny Llama every harness test runs on."""
    return tiny_model("llama", seed)
