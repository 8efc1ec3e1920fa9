"""Tiny seeded random-weight models, one per architecture the harness supports: what the
tests and the CPU smoke runs use instead of a model no hub can serve here.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from harness.models import LoadedModel, dense_attention
from harness.parsing import OneLineParser, fail, int_in, interrupts_raise, run_interruptible

# The architectures the harness is tested on, as tiny seeded random-weight models: each
# a config class, its model class and what it needs beyond the shared shape. Each brings
# one feature the hook must carry: Qwen2 biases on q/k/v, Qwen3 q/k norms (and a head_dim
# of its own), Phi-3 a fused qkv projection, Mistral a sliding window on every layer,
# Gemma 2 sliding and full layers in turn with attention and final logit softcapping and
# query_pre_attn_scalar (eager attention), Gemma 3 sliding and full layers with a rope of
# their own each and q/k norms. The windows (7, 8, 6 tokens) are narrower than the test
# prompts, and 7 and 6 are no multiple of the tests' 4-token blocks. The hybrids hold a
# recurrent state beside attention: LFM2 a short convolution (3 taps) in two of three
# layers, Qwen3-Next a gated DeltaNet layer (2 key heads, 4 value heads, 4-tap conv) and
# a mixture of 4 experts, top 2, Bamba a Mamba-2 layer (4 heads of 32, state 16, chunk
# 16). Any: transformers' config and model classes, untyped at this boundary.
# The state mixers' sizes the tiny hybrids share. Gated DeltaNet (Qwen3-Next, Qwen3.5):
GATED_DELTANET: dict[str, object] = {
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    # Byte-level prompts (``save_tiny_model``): the long built-in ones run ~1,700.
    "max_position_embeddings": 4096,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
# Four experts, two a token (Qwen3-Next, Qwen3.5 MoE).
FOUR_EXPERTS: dict[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
# Mamba-2 (Bamba, Granite 4.0, Falcon-H1), in the keywords their configs share.
MAMBA2: dict[str, object] = {
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "max_position_embeddings": 4096,
}

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
    "lfm2": (
        Lfm2Config,
        Lfm2ForCausalLM,
        {
            "num_hidden_layers": 3,
            "layer_types": ["conv", "full_attention", "conv"],
            # Byte-level prompts (``save_tiny_model``): the long built-in ones run ~1,700.
            "max_position_embeddings": 4096,
        },
    ),
    "qwen3_next": (
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        {**GATED_DELTANET, **FOUR_EXPERTS},
    ),
    # Qwen3.5: gated DeltaNet beside attention, as Qwen3-Next, dense and mixture-of-experts.
    "qwen3_5": (
        Qwen3_5TextConfig,
        Qwen3_5ForCausalLM,
        GATED_DELTANET,
    ),
    "qwen3_5_moe": (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        {**GATED_DELTANET, **FOUR_EXPERTS},
    ),
    # Granite 4.0 hybrid: Mamba-2 beside attention, a mixture of experts and a shared MLP.
    "granitemoehybrid": (
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        {
            **MAMBA2,
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 32,
        },
    ),
    # Nemotron-H: Mamba-2, attention and MLP layers, one mixer each (the MLP holds no cache).
    "nemotron_h": (
        NemotronHConfig,
        NemotronHForCausalLM,
        {
            "num_hidden_layers": 3,
            "layers_block_type": ["linear_attention", "full_attention", "mlp"],
            "head_dim": 16,
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 16,
            "use_mamba_kernels": False,  # the CUDA kernels' package: absent here
            "max_position_embeddings": 4096,
        },
    ),
    "falcon_h1": (
        FalconH1Config,
        FalconH1ForCausalLM,
        {
            **MAMBA2,
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_d_head": 16,
        },
    ),
    "bamba": (
        BambaConfig,
        BambaForCausalLM,
        {**MAMBA2, "attn_layer_indices": [1]},
    ),
}
# The architectures of TINY_ARCHITECTURES that are hybrids (a recurrent state group).
HYBRID_ARCHITECTURES = (
    "lfm2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "bamba",
)


def tiny_model(architecture: str, seed: int) -> LoadedModel:
    """A seeded random-weight model of ``architecture`` (a key of ``TINY_ARCHITECTURES``),
    small enough for fast CPU tests (no tokenizer: feed ids).

    Two KV heads under four query heads, so grouped-query attention is exercised as in
    SmolLM2 (nine query heads over three KV heads).
    """
    config_class, model_class, extra = TINY_ARCHITECTURES[architecture]
    shape: dict[str, object] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    config = config_class(**(shape | extra))
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


# A ChatML template with a default system turn, as SmolLM2's and Qwen's have: every
# built-in prompt without a system message starts with the same ~75 bytes.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 256 ids, one per byte (the tiny models' vocabulary), with
    ``CHAT_TEMPLATE``: any text tokenizes, and decodes back."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Byte b's symbol is the one GPT-2's byte-level map gives it: build that order.
    byte_symbols = _byte_symbols()
    assert set(byte_symbols) == set(alphabet), "byte-level alphabet changed"
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map, byte 0 to 255: printable bytes stand for themselves,
    the rest for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def save_tiny_model(architecture: str, seed: int, directory: Path) -> Path:
    """``tiny_model(architecture, seed)`` saved as a HF model directory with
    ``byte_tokenizer()``: what ``python -m harness --model DIRECTORY`` loads."""
    model = tiny_model(architecture, seed).model
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


PROG = "python -m harness.tiny_models"
# torch.manual_seed takes a seed up to 2**64 - 1 (and overflows past it).
MAX_SEED = 2**64 - 1


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Save a tiny seeded random-weight model as a HF model directory (its "
        "weights, config and a byte-level tokenizer with a chat template) that "
        "python -m harness --model DIRECTORY loads.",
    )
    parser.add_argument(
        "architecture",
        metavar="ARCHITECTURE",
        choices=TINY_ARCHITECTURES,
        help=f"one of {', '.join(TINY_ARCHITECTURES)} "
        f"(the hybrids: {', '.join(HYBRID_ARCHITECTURES)})",
    )
    parser.add_argument(
        "directory",
        metavar="DIRECTORY",
        type=Path,
        help="where to save it: a new directory in an existing one, or an existing directory "
        "(its files of the same names are replaced, the others kept)",
    )
    parser.add_argument(
        "seed",
        metavar="SEED",
        nargs="?",
        type=int_in(0, MAX_SEED),
        default=0,
        help="the weights' random seed (default 0)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.tiny_models ARCHITECTURE DIRECTORY [SEED]``: save a tiny model
    and say where; exit 2 with one line for bad arguments or a destination not written."""
    interrupts_raise()
    args = build_parser().parse_args(argv)
    return run_interruptible(PROG, lambda: _save(args.architecture, args.seed, args.directory))


def _save(architecture: str, seed: int, directory: Path) -> int:
    """Save the model into a temporary directory beside ``directory``, then move it in: a
    failure or Ctrl-C leaves ``directory`` as it was (a file at a time, for one that exists)."""
    if directory.exists() and not directory.is_dir():
        return fail(PROG, f"{str(directory)!r} exists and is not a directory")
    if not directory.parent.is_dir():
        return fail(
            PROG,
            f"no directory {str(directory.parent)!r} to write {str(directory)!r} into",
        )
    try:
        temporary = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    except OSError as error:
        return fail(PROG, f"cannot write {str(directory)!r}: {error.strerror or error}")
    try:
        save_tiny_model(architecture, seed, temporary)
        if directory.is_dir():
            for saved in temporary.iterdir():
                saved.replace(directory / saved.name)
        else:
            temporary.rename(directory)
    except OSError as error:
        return fail(PROG, f"cannot write {str(directory)!r}: {error.strerror or error}")
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    print(f"saved tiny {architecture} (seed {seed}) to {directory.absolute()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
