"""The three ways the decode benchmark generates a batch: dense ``generate``, the paged
engine, and transformers' own continuous batching (``generate_batch``).

Each decodes exactly ``new_tokens`` tokens per request (EOS ignored) and returns each
request's tokens; ``harness.bench.decode`` times them in turns.
"""

from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from harness.models import LoadedModel, kv_layout
from harness.oracle.dense import generate_dense_batch
from harness.runtime.attention_backends import GATHER, AttentionBackend
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, new_manager
from harness.runtime.requests import Request
from harness.runtime.results import EngineResult
from spec import blocks_for_tokens

HF_CB_MAX_BATCH_TOKENS = 512


def run_dense(
    loaded: LoadedModel, batch: list[tuple[int, ...]], new_tokens: int
) -> list[list[int]]:
    """dense: ``batch`` as one left-padded static batch through ``model.generate``."""
    pad = loaded.eos_token_id if loaded.eos_token_id is not None else 0
    return generate_dense_batch(loaded.model, batch, new_tokens, pad)


def run_paged(
    loaded: LoadedModel,
    batch: list[tuple[int, ...]],
    new_tokens: int,
    *,
    block_size: int,
    peak: list[int],
    attention: AttentionBackend,
) -> list[list[int]]:
    """paged: ``batch`` through the engine, all arriving at once, on a pool that holds them
    all; appends the run's peak blocks in use to ``peak``."""
    requests = [Request(f"r{i}", prompt, new_tokens) for i, prompt in enumerate(batch)]
    result = run_engine_holding_all(loaded, requests, block_size, attention)
    peak.append(result.peak_used_blocks)
    return [result.outputs[request.request_id].token_ids for request in requests]


def run_engine_holding_all(
    loaded: LoadedModel,
    requests: list[Request],
    block_size: int,
    attention: AttentionBackend = GATHER,
) -> EngineResult:
    """``requests`` through the ``Engine`` on a fresh pool that holds them all at once, no
    EOS and no prefix caching (so the engine prefills what a dense batch prefills)."""
    layout = kv_layout(loaded)
    group_count = len(layout.group_windows)
    total_blocks = sum(request.blocks_needed(block_size, group_count) for request in requests)
    manager = new_manager(layout, total_blocks, block_size)
    pool = PagedKVPool(layout, total_blocks, block_size)
    engine = Engine(loaded.model, manager, pool, None, prefix_caching=False, attention=attention)
    return engine.run(requests)


def hf_cb_num_blocks(batch: list[tuple[int, ...]], new_tokens: int, block_size: int) -> int:
    """The pool the paged engine gets for ``batch``, so both hold every request at once."""
    return sum(blocks_for_tokens(block_size, len(p) + new_tokens) for p in batch)


def hf_cb_config(total_blocks: int, block_size: int) -> ContinuousBatchingConfig:
    """An explicitly sized config: without one HF sizes its cache from free memory (on CPU
    60% of RAM per call: 12.6 GB RSS and 27 s for a batch-1 run), which would measure the
    sizing, not the batching.
    """
    return ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=total_blocks,  # HF's name for the pool's block count
        max_batch_tokens=HF_CB_MAX_BATCH_TOKENS,
        allow_block_sharing=False,  # the engine runs without prefix caching here too
        auto_switch_to_flash=False,  # the same SDPA attention as the other two methods
    )


def hf_cb_config_text(block_size: int) -> str:
    """hf-cb's config, in words for the table's header."""
    return (
        f"page_size {block_size}, num_blocks = the paged pool's, max_batch_tokens "
        f"{HF_CB_MAX_BATCH_TOKENS}, no block sharing, no switch to flash"
    )


def run_generate_batch(
    loaded: LoadedModel, batch: list[tuple[int, ...]], new_tokens: int, *, block_size: int
) -> list[list[int]]:
    """hf-cb: ``batch`` through transformers' ``generate_batch`` (``hf_cb_config``)."""
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.eos_token_id if loaded.eos_token_id is not None else 0,
    )
    cb_config = hf_cb_config(hf_cb_num_blocks(batch, new_tokens, block_size), block_size)
    model: Any = loaded.model  # Any: a transformers causal LM
    outputs = model.generate_batch(
        [list(p) for p in batch], generation_config=config, continuous_batching_config=cb_config
    )
    if len(outputs) != len(batch):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(batch)} requests")
    # Ordered as the inputs (generate_batch reorders its results so).
    return [list(output.generated_tokens) for output in outputs.values()]
