"""``check_model``: the three paged-vs-dense checks on a model the caller has loaded.

The public call for users' own tests (and what the main command runs): the model as the
user loaded it, on its device and in its dtype; prompts as text, chat messages or token
ids; every other setting defaulted as the command line defaults it. It loads nothing and
prints nothing (``progress`` gets the stage lines when given).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from harness.cli.limits import (
    available_bytes,
    check_context,
    check_host_memory,
    check_memory,
    check_options,
    model_context,
)
from harness.cli.parsing import UsageError
from harness.kv_events import KVEventLog
from harness.models import LoadedModel, kv_layout
from harness.oracle.equivalence import (
    EquivalenceReport,
    PoolConfig,
    run_equivalence,
    tight_total_blocks,
)
from harness.prompts import render_prompt
from harness.runtime.attention_backends import ATTENTION_BACKENDS
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.events import PoolObserver
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.preemption import PREEMPT_MODES
from harness.runtime.requests import Request
from harness.runtime.scheduler import Scheduling


class CheckSettingsError(ValueError):
    """A ``check_model`` setting or prompt no run can take; the message names it."""


# A prompt: text (one user message), chat messages ({"role": ..., "content": ...}, rendered
# with the tokenizer's chat template), or token ids as they are.
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


def check_model(
    model: torch.nn.Module,  # a transformers PreTrainedModel
    tokenizer: Any,  # Any: a transformers tokenizer (None when every prompt is token ids)
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 64,
    block_size: int = 16,
    total_blocks: int | None = None,
    attention: str = "gather",
    prefix_cache: bool = True,
    poison_freed: bool = False,
    n: int = 1,
    arrival_gap: int = 2,
    batch_invariant: bool = False,
    speculate: int | None = None,
    max_batch_tokens: int | None = None,
    salts: int | None = None,
    preempt: str = "recompute",
    host_blocks: int | None = None,
    name: str | None = None,
    observer: PoolObserver | None = None,
    kv_events: KVEventLog | None = None,
    progress: Callable[[str], None] | None = None,
) -> EquivalenceReport:
    """Generate every prompt with ``model`` (HF's dense cache) and through a paged KV pool,
    and run the three checks per request; ``report.passed`` says whether all passed.

    ``total_blocks=None``: about a quarter of what all requests need at once (so blocks are
    reused and requests preempted), at least one whole request. ``n``: continuations per
    prompt (forked, sharing the prompt's blocks). ``salts=K``: K cache salts (``tenant0`` ..
    ``tenant{K-1}``) assigned round-robin over the prompts, so a prompt hits only blocks of
    its own tenant; ``None``: no salt. ``preempt``: how a request is preempted when the
    pool is dry, ``"recompute"`` or ``"swap"`` (to a host tier, falling back to recompute
    when it is full). ``host_blocks``: the host tier's blocks; given, it also keeps freed
    cached prefixes (a later hit copies them back); ``None``: as many as the pool with
    ``"swap"``, none otherwise. ``kv_events`` records the KV cache events of the
    continuous-batching run (check 3), each with its engine step. Refuses bad settings
    with ``CheckSettingsError`` (``UsageError`` for what the model cannot serve) before
    any generation.
    """
    if preempt not in PREEMPT_MODES:
        raise CheckSettingsError(f"preempt {preempt!r} is not one of {list(PREEMPT_MODES)}")
    if attention not in ATTENTION_BACKENDS:
        known = sorted(ATTENTION_BACKENDS)
        raise CheckSettingsError(f"attention {attention!r} is not one of {known}")
    for setting, value, least in (
        ("max_new_tokens", max_new_tokens, 1),
        ("block_size", block_size, 1),
        ("n", n, 1),
        ("arrival_gap", arrival_gap, 0),
        ("speculate", speculate, 1),
        ("max_batch_tokens", max_batch_tokens, 1),
        ("salts", salts, 1),
        ("host_blocks", host_blocks, 1),
    ):
        if value is not None and value < least:
            raise CheckSettingsError(f"{setting} must be >= {least}, got {value}")
    if not prompts:
        raise CheckSettingsError("no prompts to check")
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name or _model_name(model))
    layout = kv_layout(loaded)  # refuses a model the paged hook cannot run exactly
    check_options(model, block_size, max_new_tokens, n)
    backend = ATTENTION_BACKENDS[attention]
    backend.check(model, layout, block_size)
    requests = [
        Request(
            f"r{number:02d}",
            prompt_ids(tokenizer, prompt),
            max_new_tokens,
            arrival_step=number * arrival_gap,
            num_continuations=n,
            cache_salt=None if salts is None else f"tenant{number % salts}",
        )
        for number, prompt in enumerate(prompts)
    ]
    check_context(requests, model_context(model))
    blocks = _total_blocks(requests, block_size, total_blocks, len(layout.group_windows))
    # Before any pool (or the manager's free list) is built.
    host = host_blocks if host_blocks is not None else blocks if preempt == "swap" else 0
    check_memory(
        requests, blocks, block_size, layout, available_bytes(layout.device), host_blocks=host
    )
    check_host_memory(host, block_size, layout, available_bytes(torch.device("cpu")))
    pool = PoolConfig(
        total_blocks=blocks,
        block_size=block_size,
        engine_type=BatchInvariantEngine if batch_invariant else Engine,
        pool_type=backend.poisoned_pool_type if poison_freed else PagedKVPool,
        prefix_caching=prefix_cache,
        observer=observer,
        kv_events=kv_events,
        scheduling=Scheduling(speculate or 0, max_batch_tokens),
        attention=backend,
        preemption="swap" if preempt == "swap" else "recompute",
        host_blocks=host,
        host_prefix_cache=host_blocks is not None and prefix_cache,
    )
    return run_equivalence(loaded, requests, pool, progress or _quiet)


def prompt_ids(
    tokenizer: Any,  # Any: a transformers tokenizer, or None for token-id prompts
    prompt: Prompt,
) -> tuple[int, ...]:
    """``prompt``'s token ids: text and chat messages through the chat template, ids as given."""
    if isinstance(prompt, str):
        messages: Sequence[Mapping[str, str]] | None = [{"role": "user", "content": prompt}]
    elif all(isinstance(item, int) for item in prompt):
        messages = None
    elif all(isinstance(item, Mapping) for item in prompt):
        messages = [item for item in prompt if isinstance(item, Mapping)]
    else:
        raise CheckSettingsError(
            "a prompt is a string, a list of chat messages or a list of token ids"
        )
    if messages is None:
        ids = tuple(int(item) for item in prompt if isinstance(item, int))
        if not ids:
            raise CheckSettingsError("a token-id prompt needs at least one token")
        return ids
    if tokenizer is None:
        raise CheckSettingsError(
            "text and chat prompts need a tokenizer (pass token ids without one)"
        )
    return render_prompt(tokenizer, tuple((m["role"], m["content"]) for m in messages))


def _total_blocks(
    requests: list[Request], block_size: int, requested: int | None, group_count: int
) -> int:
    if requested is None:
        return tight_total_blocks(requests, block_size, group_count)
    needs = [request.blocks_needed(block_size, group_count) for request in requests]
    if requested < max(needs):
        longest = max(range(len(requests)), key=lambda index: needs[index])
        raise UsageError(
            f"--total-blocks {requested} cannot hold even one request: "
            f"{requests[longest].request_id} "
            f"needs {needs[longest]} blocks of {block_size} tokens "
            f"({requests[longest].max_tokens} tokens, {requests[longest].num_continuations} "
            "continuations)"
        )
    return requested


def _model_name(model: Any) -> str:  # Any: a transformers PreTrainedModel
    name = getattr(model, "name_or_path", "")
    return name if isinstance(name, str) and name else type(model).__name__


def _quiet(_message: str) -> None:
    pass
