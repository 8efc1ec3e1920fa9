"""A seeded random model of SmolLM2-135M's exact shapes, for the GPU check on a machine
without the bundled GGUF (and for its CPU smoke run, at smaller shapes)."""

import math
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from harness.gpu_check.gpu_plan import ModelShape


def random_smollm2(
    shape: ModelShape, dtype: torch.dtype, device: torch.device
) -> Any:  # Any: a transformers LlamaForCausalLM
    """A seeded random Llama of ``shape`` whose logits look like a trained model's.

    NOTE: default init gives near-uniform logits (argmax ties everywhere). A gain of
    1.5/sqrt(fan_in) on every matrix and embeddings of std 0.3 gave a median top-1 logit of
    29.5 at SmolLM2's shapes, against 28.2 for the real model, so the bf16 grid spacing
    at the top-1 logit (what the tie rule counts in) is the real run's.
    Built in float32 from a CPU seed, then loaded into a model made with ``dtype=`` as
    ``from_pretrained`` makes it: the rotary ``inv_freq`` stays float32.
    """
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    source = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if "embed_tokens" in name:
                parameter.normal_(0.0, 0.3)
            elif parameter.dim() == 2:
                parameter.normal_(0.0, 1.5 / math.sqrt(parameter.shape[1]))
    model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.load_state_dict(source.state_dict())
    model.to(device)
    model.eval()
    model.set_attn_implementation("sdpa")
    return model
