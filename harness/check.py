"""``check_model``: the three paged-vs-dense checks on a model the caller has loaded.

The public call for users' own tests (and what the main command runs): the model as the
user loaded it, on its device and in its dtype; prompts as text, chat messages or token
ids; the settings (``CheckSettings``) defaulted as the command line defaults them. Every
argument is checked before anything is generated: the settings when they are built, then
the model, the tokenizer, the prompts and what the model and the machine can hold, each
refusal a ``CheckSettingsError`` naming the keyword. It loads nothing and prints nothing
(``progress`` gets the stage lines when given).
"""

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, Unpack

import torch
from transformers import PreTrainedModel

from harness.kv_events import KVEventLog
from harness.limits import (
    available_bytes,
    check_context,
    check_host_memory,
    check_memory,
    check_options,
    model_context,
    model_vocab_size,
)
from harness.models import LoadedModel, kv_layout
from harness.oracle.equivalence import (
    EquivalenceReport,
    PoolConfig,
    run_equivalence,
    tight_total_blocks,
)
from harness.prompts import PromptTextError, check_prompt_text, render_prompt
from harness.runtime.attention_backends import ATTENTION_BACKENDS
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.events import PoolObserver
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.requests import Request
from harness.runtime.scheduler import Scheduling, group_counts
from harness.runtime.user_kernel import user_kernel_backend
from harness.settings import (
    CheckSettings,
    CheckSettingsError,
    CheckSettingsKeywords,
    check_attention_only_settings,
    check_hybrid_settings,
)
from harness.state_models import default_interval

# A prompt: text (one user message), chat messages ({"role": ..., "content": ...}, rendered
# with the tokenizer's chat template), or token ids as they are.
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


def check_model(
    model: torch.nn.Module,  # a transformers PreTrainedModel
    tokenizer: Any,  # Any: a transformers tokenizer (None when every prompt is token ids)
    prompts: Sequence[Prompt],
    settings: CheckSettings | None = None,
    *,
    name: str | None = None,
    observer: PoolObserver | None = None,
    kv_events: KVEventLog | None = None,
    progress: Callable[[str], None] | None = None,
    **keywords: Unpack[CheckSettingsKeywords],
) -> EquivalenceReport:
    """Generate every prompt with ``model`` (HF's dense cache) and through a paged KV pool,
    and run the three checks per request; ``report.passed`` says whether all passed.

    ``settings`` (``CheckSettings()`` when ``None``) with any setting given as a keyword
    in its place (``check_model(model, None, prompts, max_new_tokens=8)``). ``name``
    titles the report (default: the model's ``name_or_path``); ``observer`` watches the
    pool during the continuous-batching run (check 3), ``kv_events`` records its KV cache
    events, each with its engine step. Refuses a bad setting, model, tokenizer or prompt
    with ``CheckSettingsError`` (``UnsupportedModelError`` or ``AttentionBackendError``
    for what the paged hook or the attention backend cannot run) before any generation.
    """
    chosen = _settings(settings, keywords)
    _check_arguments(
        model, tokenizer, name=name, observer=observer, kv_events=kv_events, progress=progress
    )
    vocab_size = model_vocab_size(model)
    ids = [
        prompt_ids(tokenizer, prompt, f"prompts[{number}]", vocab_size)
        for number, prompt in enumerate(_prompt_list(prompts))
    ]
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name or _model_name(model))
    interval = chosen.checkpoint_interval or default_interval(chosen.block_size)
    layout = kv_layout(loaded, interval)  # refuses a model the paged hook cannot run exactly
    if layout.state_layers:
        check_hybrid_settings(chosen, interval, max(len(prompt) for prompt in ids))
    else:
        check_attention_only_settings(chosen)
    check_options(model, chosen.block_size, chosen.max_new_tokens, chosen.n)
    backend = (
        ATTENTION_BACKENDS[chosen.attention]
        if isinstance(chosen.attention, str)
        else user_kernel_backend(chosen.attention)
    )
    backend.check(model, layout, chosen.block_size)
    requests = [
        Request(
            f"r{number:02d}",
            prompt,
            chosen.max_new_tokens,
            arrival_step=number * chosen.arrival_gap,
            num_continuations=chosen.n,
            cache_salt=None if chosen.salts is None else f"tenant{number % chosen.salts}",
        )
        for number, prompt in enumerate(ids)
    ]
    check_context(requests, model_context(model))
    blocks = _total_blocks(requests, chosen, group_counts(layout.group_windows))
    # Before any pool (or the manager's free list) is built.
    host = _host_blocks(chosen, blocks)
    check_memory(
        requests,
        blocks,
        chosen.block_size,
        layout,
        available_bytes(layout.device),
        host_blocks=host,
    )
    check_host_memory(host, chosen.block_size, layout, available_bytes(torch.device("cpu")))
    pool = PoolConfig(
        total_blocks=blocks,
        block_size=chosen.block_size,
        engine_type=BatchInvariantEngine if chosen.batch_invariant else Engine,
        pool_type=backend.poisoned_pool_type if chosen.poison_freed else PagedKVPool,
        prefix_caching=chosen.prefix_cache,
        observer=observer,
        kv_events=kv_events,
        scheduling=Scheduling(
            chosen.speculate or 0,
            chosen.max_batch_tokens,
            checkpoint_interval=interval if layout.state_layers else 0,
        ),
        attention=backend,
        preemption=chosen.preempt,
        host_blocks=host,
        host_prefix_cache=chosen.host_blocks is not None and chosen.prefix_cache,
    )
    return run_equivalence(loaded, requests, pool, progress or _quiet)


def prompt_ids(
    tokenizer: Any,  # Any: a transformers tokenizer, or None for token-id prompts
    prompt: object,
    where: str = "prompt",
    vocab_size: int | None = None,
) -> tuple[int, ...]:
    """``prompt``'s token ids: text and chat messages through the chat template, ids as
    given; ``CheckSettingsError`` (naming ``where``) for anything else, an id that is not
    an ``int`` or, given ``vocab_size``, an id outside the vocabulary."""
    messages = _messages(prompt, where)
    if messages is None:
        assert isinstance(prompt, Sequence)  # _messages said it is token ids
        ids: Sequence[object] = prompt
        if not ids:
            raise CheckSettingsError(
                "prompts", f"{where}: a token-id prompt needs at least one token"
            )
    elif tokenizer is None:
        raise CheckSettingsError(
            "prompts", f"{where}: text and chat prompts need a tokenizer (pass token ids)"
        )
    elif getattr(tokenizer, "chat_template", None) is None:
        raise CheckSettingsError(
            "tokenizer",
            f"tokenizer has no chat template, which {where} (text or chat) goes through "
            "(pass token ids instead)",
        )
    else:
        ids = render_prompt(tokenizer, messages)
    checked = []
    for position, token_id in enumerate(ids):
        if type(token_id) is not int or token_id < 0:
            raise CheckSettingsError(
                "prompts",
                f"{where}: token {position} is {type(token_id).__name__} {token_id!r}; "
                "token ids are ints >= 0",
            )
        if vocab_size is not None and token_id >= vocab_size:
            raise CheckSettingsError(
                "prompts",
                f"{where}: token {position} is {token_id}, outside the model's vocabulary "
                f"of {vocab_size} tokens (ids 0 to {vocab_size - 1})",
            )
        checked.append(token_id)
    return tuple(checked)


def _messages(prompt: object, where: str) -> tuple[tuple[str, str], ...] | None:
    """``prompt`` as (role, content) messages; ``None`` for token ids."""
    if isinstance(prompt, str):
        _check_text(prompt, where)
        return (("user", prompt),)
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray):
        raise CheckSettingsError(
            "prompts",
            f"{where} is {type(prompt).__name__} {prompt!r:.60}: a prompt is a string, a list of "
            "chat messages or a list of token ids (one token-id prompt is [[1, 2, 3]], not "
            "[1, 2, 3])",
        )
    if not prompt or not any(isinstance(item, Mapping) for item in prompt):
        return None  # token ids, each checked by the caller
    messages = []
    for number, message in enumerate(prompt):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if not (isinstance(role, str) and isinstance(content, str)):
            raise CheckSettingsError(
                "prompts",
                f"{where}[{number}]: a chat message is a mapping with string 'role' and "
                f"'content', got {message!r:.60}",
            )
        _check_text(role, f"{where}[{number}]")
        _check_text(content, f"{where}[{number}]")
        messages.append((role, content))
    return tuple(messages)


def _check_text(text: str, where: str) -> None:
    try:
        check_prompt_text(text, where)
    except PromptTextError as error:
        raise CheckSettingsError("prompts", str(error)) from None


def _prompt_list(prompts: object) -> Sequence[object]:
    if isinstance(prompts, str | bytes | bytearray) or not isinstance(prompts, Sequence):
        raise CheckSettingsError(
            "prompts",
            f"prompts must be a list of prompts, got {type(prompts).__name__} {prompts!r:.60}",
        )
    if not prompts:
        raise CheckSettingsError("prompts", "prompts is empty: no prompts to check")
    return prompts


def _settings(settings: object, keywords: CheckSettingsKeywords) -> CheckSettings:
    """``settings`` with the keyword settings in place of its fields."""
    if settings is None:
        settings = CheckSettings()
    if not isinstance(settings, CheckSettings):
        raise CheckSettingsError(
            "settings",
            f"settings must be a CheckSettings or None, got {type(settings).__name__}",
        )
    known = [setting.name for setting in fields(CheckSettings)]
    for keyword in keywords:
        if keyword not in known:
            raise CheckSettingsError(
                keyword, f"{keyword} is not a setting of check_model (one of {known})"
            )
    return replace(settings, **keywords)


def _check_arguments(
    model: object,
    tokenizer: object,
    *,
    name: object,
    observer: object,
    kv_events: object,
    progress: object,
) -> None:
    """Refuse a model, tokenizer or collaborator of the wrong kind, naming its keyword."""
    if not isinstance(model, PreTrainedModel):
        raise CheckSettingsError(
            "model",
            f"model must be a transformers PreTrainedModel, got {type(model).__name__}",
        )
    _check_device(model)
    apply_chat_template = getattr(tokenizer, "apply_chat_template", None)
    if tokenizer is not None and not (callable(tokenizer) and callable(apply_chat_template)):
        raise CheckSettingsError(
            "tokenizer",
            "tokenizer must be a transformers tokenizer (callable, with apply_chat_template) "
            f"or None, got {type(tokenizer).__name__} {tokenizer!r:.40}",
        )
    for keyword, value, wanted, kind in (
        ("name", name, str, "a str"),
        ("kv_events", kv_events, KVEventLog, "a harness.kv_events.KVEventLog"),
    ):
        if value is not None and not isinstance(value, wanted):
            raise CheckSettingsError(
                keyword, f"{keyword} must be {kind} or None, got {type(value).__name__}"
            )
    for keyword, value in (("observer", observer), ("progress", progress)):
        if value is not None and not callable(value):
            raise CheckSettingsError(
                keyword, f"{keyword} must be callable or None, got {type(value).__name__}"
            )


def _check_device(model: PreTrainedModel) -> None:
    """Refuse a model whose parameters and buffers are not all on one device with values:
    the pool, the inputs and the state rows go on the device of its first parameter, and a
    meta tensor (a model built without its weights) fails inside ``generate``."""
    counts: Counter[torch.device] = Counter()
    first: dict[torch.device, str] = {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        counts[tensor.device] += 1
        first.setdefault(tensor.device, name)
    meta = torch.device("meta")
    if len(counts) <= 1 and meta not in counts:
        return
    where = " and ".join(
        f"{device} ({count}, the first {first[device]!r})" for device, count in counts.items()
    )
    why = (
        "the meta device holds none: load the weights"
        if meta in counts
        else "move it to one with model.to(device)"
    )
    raise CheckSettingsError(
        "model",
        f"model has its {len(tensors)} parameters and buffers on {where}: check_model runs "
        f"on one device, the model's, with every value loaded ({why})",
    )


def _total_blocks(requests: list[Request], settings: CheckSettings, groups: tuple[int, int]) -> int:
    """The pool's blocks for ``groups`` (attention groups, state groups)."""
    block_size = settings.block_size
    if settings.total_blocks is None:
        return tight_total_blocks(requests, block_size, *groups)
    needs = [request.blocks_needed(block_size, *groups) for request in requests]
    if settings.total_blocks < max(needs):
        longest = max(range(len(requests)), key=lambda index: needs[index])
        raise CheckSettingsError(
            "total_blocks",
            f"total_blocks {settings.total_blocks} cannot hold even one request: "
            f"{requests[longest].request_id} "
            f"needs {needs[longest]} blocks of {block_size} tokens "
            f"({requests[longest].max_tokens} tokens, {requests[longest].num_continuations} "
            "continuations)",
        )
    return settings.total_blocks


def _host_blocks(settings: CheckSettings, total_blocks: int) -> int:
    """The host tier's blocks: as given, else the pool's with swap, else none."""
    if settings.host_blocks is not None:
        return settings.host_blocks
    return total_blocks if settings.preempt == "swap" else 0


def _model_name(model: Any) -> str:  # Any: a transformers PreTrainedModel
    name = getattr(model, "name_or_path", "")
    return name if isinstance(name, str) and name else type(model).__name__


def _quiet(_message: str) -> None:
    pass
