"""What the paged attention hook does not implement is refused in one line, never dropped;
what it does implement (sliding windows, softcapping under eager attention) passes.

``harness.models.check_supported`` refuses by the model's config and modules; the hook
refuses by the arguments transformers passes it, for a model that got past the first
check. Tiny seeded random-weight models built from transformers configs, no download.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import harness.models
from harness.kv_layout import KVLayout
from harness.models import (
    LoadedModel,
    UnsupportedModelError,
    check_supported,
    kv_layout,
    layer_windows,
    load_model,
)
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, new_manager
from harness.runtime.paged_attention import check_attention_kwargs
from harness.runtime.requests import Request
from harness.tiny_models import tiny_llama
from impl import KVCacheManager
from tests.support.harness_cases import save_model_directory, tiny_model

# Any: the keyword arguments of several transformers config classes.
SHAPE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
}


def _mistral(sliding_window: int | None) -> Any:  # Any: a transformers PreTrainedModel
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=sliding_window)).eval()


def _gemma2(**overrides: Any) -> Any:  # Any: config values; a transformers PreTrainedModel
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(**SHAPE, **overrides)).eval()


def _gpt_oss() -> Any:  # Any: a transformers PreTrainedModel
    torch.manual_seed(0)
    config = GptOssConfig(
        **SHAPE,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=None,
        layer_types=["full_attention"] * 2,
    )
    return GptOssForCausalLM(config).eval()


def _gemma3(**overrides: Any) -> Any:  # Any: config values; a transformers PreTrainedModel
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, **overrides)).eval()


def _refusal(model: Any) -> str:  # Any: a transformers PreTrainedModel
    with pytest.raises(UnsupportedModelError) as refused:
        check_supported(model)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_tiny_llama_is_supported() -> None:
    check_supported(tiny_model().model)


def test_a_sliding_window_narrower_than_the_context_is_supported() -> None:
    check_supported(_mistral(sliding_window=8))


def test_gemma2_with_softcapping_and_sliding_layers_is_supported_under_eager_attention() -> None:
    model = _gemma2(sliding_window=8)
    assert model.config._attn_implementation == "eager"
    check_supported(model)


def test_gemma3_with_sliding_and_full_layers_is_supported() -> None:
    check_supported(_gemma3(sliding_window=8))


def test_attention_logit_softcapping_under_sdpa_is_refused() -> None:
    # Gemma 3 never passes its softcap to attention; HF's SDPA wrapper raises on one.
    message = _refusal(_gemma3(sliding_window=8, attn_logit_softcapping=50.0))
    assert message == (
        "Gemma3ForCausalLM is not supported by the paged attention hook: "
        "attn_logit_softcapping=50.0 under attn_implementation='sdpa' (only eager attention "
        "softcaps scores)"
    )


def test_bidirectional_attention_is_refused() -> None:
    message = _refusal(_gemma3(sliding_window=8, use_bidirectional_attention=True))
    assert message.endswith(": use_bidirectional_attention=True (the hook is causal)")


def test_a_layer_type_other_than_full_or_sliding_is_refused() -> None:
    model = _gemma2(sliding_window=8, layer_types=["chunked_attention", "full_attention"])
    assert _refusal(model).endswith(
        "layer_types has ['chunked_attention'] (the hook implements full_attention and "
        "sliding_attention, layers with no cache (mlp, moe), and the state layers of bamba, "
        "falcon_h1, granitemoehybrid, lfm2, nemotron_h, qwen3_5_moe_text, qwen3_5_text and "
        "qwen3_next models)"
    )


def test_attention_sinks_are_refused() -> None:
    assert _refusal(_gpt_oss()) == (
        "GptOssForCausalLM is not supported by the paged attention hook: attention sinks "
        "(model.layers.0.self_attn.sinks and 1 more; the hook's softmax has no sink term)"
    )


def test_another_attention_implementation_is_refused() -> None:
    model = tiny_llama(seed=1).model
    model.set_attn_implementation("flex_attention")
    assert _refusal(model) == (
        "LlamaForCausalLM is not supported by the paged attention hook: "
        "attn_implementation='flex_attention' (the hook mirrors 'sdpa' or 'eager', whichever "
        "the dense reference runs)"
    )


def test_training_mode_is_refused() -> None:
    model = _mistral(sliding_window=None).train()
    assert _refusal(model).endswith("the model is in training mode (dropout; call model.eval())")


def test_no_pool_layout_is_made_for_an_unsupported_model() -> None:
    # kv_layout is how a PagedKVPool (and so a PagedCache) is sized for a model.
    with pytest.raises(UnsupportedModelError):
        kv_layout(LoadedModel(model=_gpt_oss(), tokenizer=None, name="m"))


def test_the_layout_carries_each_layers_window() -> None:
    mistral = kv_layout(LoadedModel(model=_mistral(sliding_window=8), tokenizer=None, name="m"))
    gemma2 = kv_layout(LoadedModel(model=_gemma2(sliding_window=8), tokenizer=None, name="g"))
    llama = kv_layout(tiny_model())
    assert (mistral.layer_windows, gemma2.layer_windows, llama.layer_windows) == (
        (8, 8),
        (8, None),
        (),
    )
    assert (gemma2.window(0), gemma2.window(1), llama.window(1)) == (8, None, None)


def test_load_model_refuses_an_unsupported_model(tmp_path: Path) -> None:
    save_model_directory(_gpt_oss(), tmp_path)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_load_model_loads_gemma2_with_eager_attention(tmp_path: Path) -> None:
    save_model_directory(_gemma2(sliding_window=8), tmp_path)
    loaded = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert loaded.model.config._attn_implementation == "eager"


def test_the_engine_refuses_an_unsupported_model() -> None:
    layout = KVLayout(2, 2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        Engine(_gpt_oss(), KVCacheManager(8, 4), PagedKVPool(layout, 8, 4), None)


# -- the hook's own refusals, with check_supported bypassed ----------------------------


def _run_unchecked(
    monkeypatch: pytest.MonkeyPatch,
    model: Any,  # Any: a transformers PreTrainedModel
    prompt_tokens: int,
) -> None:
    """Run one request through the engine with ``check_supported`` planted out."""
    monkeypatch.setattr(harness.models, "check_supported", lambda model: None)
    windows = layer_windows(model.config)
    layout = KVLayout(
        2, 2, 8, torch.float32, torch.device("cpu"), layer_windows=windows if any(windows) else ()
    )
    engine = Engine(model, new_manager(layout, 16, 4), PagedKVPool(layout, 16, 4), None)
    engine.run([Request("r0", tuple(range(1, prompt_tokens + 1)), 2)])


def test_the_hook_refuses_bidirectional_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _gemma3(sliding_window=8, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match=r"does not implement: is_causal=False$"):
        _run_unchecked(monkeypatch, model, prompt_tokens=3)


def test_the_hook_refuses_attention_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedModelError, match=r"does not implement: s_aux$"):
        _run_unchecked(monkeypatch, _gpt_oss(), prompt_tokens=3)


@pytest.mark.parametrize(
    ("mask", "dropout", "kwargs", "refused"),
    [
        (torch.ones(1, 1, 2, 2, dtype=torch.bool), 0.0, {}, "an attention_mask"),
        (None, 0.1, {}, "dropout=0.1"),
        (None, 0.0, {"softcap": 50.0}, "softcap=50.0"),
        (None, 0.0, {"position_bias": torch.zeros(1)}, "position_bias"),
        (None, 0.0, {"is_causal": False}, "is_causal=False"),
    ],
)
def test_the_hook_refuses_every_other_argument_it_would_drop(
    mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],  # Any: attention kwargs as transformers passes them
    refused: str,
) -> None:
    with pytest.raises(UnsupportedModelError, match=f"does not implement: {refused}"):
        check_attention_kwargs(mask, dropout, kwargs, "sdpa")


def test_the_hook_accepts_what_llama_passes() -> None:
    kwargs = {"scaling": 0.25, "position_ids": torch.zeros(1, 2), "use_cache": False}
    check_attention_kwargs(None, 0.0, kwargs, "sdpa")


def test_the_eager_hook_accepts_softcap_and_a_sliding_window() -> None:
    check_attention_kwargs(None, 0.0, {"softcap": 50.0, "sliding_window": 8}, "eager")
