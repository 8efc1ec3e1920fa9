"""The tiny-model equivalence on a given device and dtype, as plain functions.

``tests/harness/test_cuda.py`` asserts them on CUDA; ``scripts/gpu_check.py`` runs them on
a bare GPU machine (no pytest there, and no ``tests`` package to import) and, with
``--smoke``, on CPU. Each returns the failures it found, so an empty list is a pass.
"""

import random

import torch

from harness.kv_layout import KVLayout
from harness.models import LoadedModel, kv_layout
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PoisonedKVPool, new_manager
from harness.runtime.paged_cache import PagedCache
from harness.runtime.requests import Request
from harness.tiny_models import tiny_model


def tiny_on(device: torch.device, dtype: torch.dtype, architecture: str = "llama") -> LoadedModel:
    """The seeded tiny model on ``device`` in ``dtype`` (cast after building: both sides of
    every check use this same model, so its rounded rotary frequencies do not matter)."""
    loaded = tiny_model(architecture, seed=0)
    loaded.model.to(device=device, dtype=dtype)
    return loaded


def staggered_requests(
    count: int, vocab_size: int, max_new_tokens: int, arrival_gap: int, seed: int = 1
) -> list[Request]:
    """``count`` seeded token-id requests, prompts of 3..40 tokens, one every
    ``arrival_gap`` steps."""
    rng = random.Random(seed)
    return [
        Request(
            f"r{number}",
            tuple(rng.randrange(vocab_size) for _ in range(rng.randint(3, 40))),
            max_new_tokens,
            arrival_step=number * arrival_gap,
        )
        for number in range(count)
    ]


def poisoned_pool(layout: KVLayout, total_blocks: int, block_size: int) -> PoisonedKVPool:
    """A pool of ``layout`` whose every block is NaN until written."""
    pool = PoisonedKVPool(layout, total_blocks, block_size)
    pool.poison(list(range(total_blocks)))
    return pool


def paged_equals_dense_failures(
    device: torch.device, dtype: torch.dtype, engine_type: type[Engine], count: int = 6
) -> list[str]:
    """The three checks on ``count`` staggered requests on a poisoned pool; what failed.

    The batch-invariant engine must also take no tie.
    """
    loaded = tiny_on(device, dtype)
    vocab_size = loaded.model.config.vocab_size
    requests = staggered_requests(count, vocab_size, max_new_tokens=10, arrival_gap=1)
    pool = PoolConfig(
        total_blocks=24, block_size=4, engine_type=engine_type, pool_type=PoisonedKVPool
    )
    report = run_equivalence(loaded, requests, pool, lambda _: None)
    failures = [
        check.detail
        for row in report.rows
        for check in (row.gate, row.alone, row.batch)
        if not check.passed
    ]
    if not report.schedules_equal:
        failures.append("paged and contiguous schedules differ")
    if engine_type is BatchInvariantEngine:
        failures.extend(
            f"batch-invariant tie: {row.batch.detail}" for row in report.rows if row.batch.tie
        )
    return failures


def paged_cache_generate_failures(
    device: torch.device, dtype: torch.dtype, architecture: str = "llama"
) -> list[str]:
    """``generate`` on a ``PagedCache`` vs its dense cache, a left-padded batch of two:
    the steps whose tokens or logits differ."""
    loaded = tiny_on(device, dtype, architecture)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(loaded.model.config.vocab_size, (2, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # row 1 is left-padded
    kwargs = {
        "attention_mask": attention_mask.to(device),
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    layout = kv_layout(loaded)
    pool = poisoned_pool(layout, 32, 4)
    with torch.no_grad(), PagedCache(new_manager(layout, 32, 4), pool, 2) as cache:
        paged = loaded.model.generate(input_ids.to(device), past_key_values=cache, **kwargs)
        dense = loaded.model.generate(input_ids.to(device), **kwargs)
    failures = []
    if not torch.equal(paged.sequences, dense.sequences):
        failures.append("paged-cache generate emitted other tokens than generate")
    for step, (ours, theirs) in enumerate(zip(paged.logits, dense.logits, strict=True)):
        if not torch.equal(ours, theirs):
            failures.append(f"step {step}: paged-cache logits differ from generate's")
    return failures
