"""The limits ``check_model`` (and so ``python -m harness``) holds its settings to once the
model is loaded, checked before anything large is built.

Two come from the model, one from the machine:
- context: a request's prompt plus ``max_new_tokens`` must fit the model's
  ``max_position_embeddings``; a block no larger than that (a bigger one is never filled);
- continuations: ``n`` distinct first tokens need ``n <= vocab_size``;
- memory: the K/V tensors the run allocates (the paged pool and, for the allocator gate,
  the contiguous buffers) must fit in ``MEMORY_FRACTION`` of the memory available on the
  device when the run starts, the model already loaded; the host tier (``host_blocks``)
  in that fraction of the host's (with the pool's, on a CPU run).

Every refusal is a ``CheckSettingsError`` naming the setting (the command swaps in its
flag), with the numbers and the limit in one line. This module does not decide how big the
pool is (``check_model`` does); it only refuses what cannot run.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from harness.kv_layout import KVLayout
from harness.runtime.requests import Request
from harness.settings import CheckSettingsError

# NOTE: half, not all: the rest holds a prefill's activations (a context-long prompt's
# attention and MLP intermediates), the dense reference's own cache (one request's K/V),
# the logits kept for the checks, and whatever else runs on the machine. A margin chosen,
# not measured to the byte; the default run needs 0.28 GiB of K/V.
MEMORY_FRACTION = 0.5


def model_context(model: Any) -> int:  # Any: a transformers PreTrainedModel
    """The most tokens (prompt and new) a request may hold: ``max_position_embeddings``."""
    return int(model.config.max_position_embeddings)


def model_vocab_size(model: Any) -> int:  # Any: a transformers PreTrainedModel
    """The model's vocabulary: token ids are ``0 .. vocab_size - 1``."""
    return int(model.config.vocab_size)


def check_options(
    model: Any,  # Any: a transformers PreTrainedModel
    block_size: int,
    max_new_tokens: int,
    num_continuations: int,
) -> None:
    """Refuse a block size, a new-token count or a continuation count the model cannot serve."""
    context = model_context(model)
    if block_size > context:
        raise CheckSettingsError(
            "block_size",
            f"block_size {block_size} is larger than the model's context of {context} tokens "
            "(max_position_embeddings): no request would ever fill a block",
        )
    if max_new_tokens >= context:
        raise CheckSettingsError(
            "max_new_tokens",
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context} tokens (max_position_embeddings)",
        )
    vocab_size = model_vocab_size(model)
    if num_continuations > vocab_size:
        raise CheckSettingsError(
            "n",
            f"n {num_continuations} is more than the model's vocabulary of {vocab_size} tokens: "
            "every continuation starts from a different token",
        )


def check_context(requests: Sequence[Request], context: int) -> None:
    """Refuse the first request whose prompt plus new tokens exceed ``context`` tokens."""
    for request in requests:
        if request.max_tokens > context:
            raise CheckSettingsError(
                "prompts",
                f"{request.request_id} is too long: {len(request.prompt_ids)} prompt tokens "
                f"+ {request.max_new_tokens} new = {request.max_tokens} tokens, more than the "
                f"model's context of {context} tokens (max_position_embeddings)",
            )


def kv_bytes(
    requests: Sequence[Request], total_blocks: int, block_size: int, layout: KVLayout
) -> tuple[int, int]:
    """The K/V bytes of the paged pool (a hybrid's state rows included), and at most of
    the gate's contiguous buffers.

    The gate's contiguous run follows the paged schedule, where every live sequence holds a
    block, so at most ``min(sequences, total_blocks)`` buffers of the longest request's
    ``max_tokens`` rows exist at once.
    """
    pool = total_blocks * (block_size * layout.bytes_per_block_token + layout.state_bytes_per_block)
    sequences = sum(request.num_continuations for request in requests)
    longest = max(request.max_tokens for request in requests)
    contiguous = min(sequences, total_blocks) * longest * layout.bytes_per_token
    return pool, contiguous


def check_memory(
    requests: Sequence[Request],
    total_blocks: int,
    block_size: int,
    layout: KVLayout,
    available: int,
    *,
    host_blocks: int = 0,
) -> None:
    """Refuse a run whose K/V would take more than ``MEMORY_FRACTION`` of ``available`` bytes
    (on a CPU run with the host tier's ``host_blocks`` counted in)."""
    pool, contiguous = kv_bytes(requests, total_blocks, block_size, layout)
    host = host_blocks * block_size * layout.bytes_per_block_token
    if layout.device.type != "cpu":
        host = 0  # in host memory: check_host_memory
    limit = int(available * MEMORY_FRACTION)
    if pool + contiguous + host > limit:
        host_tier = f" and a host tier of {host_blocks} blocks ({_size(host)})" if host else ""
        raise CheckSettingsError(
            "total_blocks",
            f"total_blocks {total_blocks}: the run's K/V needs {_size(pool + contiguous + host)}: "
            f"a pool of {total_blocks} blocks x {block_size} tokens "
            f"x {layout.bytes_per_block_token} bytes{_state_rows(layout)} ({_size(pool)}) "
            f"and the gate's contiguous buffers ({_size(contiguous)}){host_tier}; the limit is "
            f"{MEMORY_FRACTION:g} of the {_size(available)} of {layout.device.type} memory "
            f"available, {_size(limit)}",
        )


def _state_rows(layout: KVLayout) -> str:
    """A hybrid's state rows per block, as a clause of the memory refusal ("" without)."""
    if not layout.state_layers:
        return ""
    return f" and {layout.state_bytes_per_block} bytes of state rows a block"


def check_host_memory(host_blocks: int, block_size: int, layout: KVLayout, available: int) -> None:
    """Refuse a host tier of a device run larger than ``MEMORY_FRACTION`` of the host's
    ``available`` bytes (a CPU run counts it in ``check_memory``)."""
    host = host_blocks * block_size * layout.bytes_per_block_token
    limit = int(available * MEMORY_FRACTION)
    if layout.device.type != "cpu" and host > limit:
        raise CheckSettingsError(
            "host_blocks",
            f"host_blocks {host_blocks} needs {_size(host)} of host memory ({block_size} tokens "
            f"x {layout.bytes_per_block_token} bytes a block); the limit is {MEMORY_FRACTION:g} "
            f"of the {_size(available)} available, {_size(limit)}",
        )


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device`` now: CUDA's free memory, or on the CPU
    Linux's ``MemAvailable`` capped by this process's cgroup (v2) limit."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = (cgroup / "memory.current").read_text().strip()
    except OSError:
        return available
    if limit == "max":
        return available
    return min(available, int(limit) - int(used))


def _meminfo_available() -> int:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the value is in kB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _size(count: int) -> str:
    """Bytes in the largest unit of at least one: GiB, MiB, else bytes."""
    if count >= 2**30:
        return f"{count / 2**30:,.2f} GiB"
    if count >= 2**20:
        return f"{count / 2**20:,.2f} MiB"
    return f"{count:,} bytes"
