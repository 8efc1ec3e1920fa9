"""``python -m harness.bench.speculation``: decode tok/s with and without speculative decoding.

Two prompt sets, each run as one batch through the paged engine (all requests arriving at
once, no prefix caching, EOS ignored so every request decodes exactly
``--max-new-tokens``):
- ``quoting``: prompts whose answer repeats their context (edit a function and return it
  whole, copy a passage out, correct a paragraph), where prompt-lookup drafts should hit;
- ``chat``: the first built-in chat prompts, whose answers rarely quote them.
Each set runs without speculation (``plain``) and with ``--speculate K`` (``spec K``).
Decode tokens/s is ``batch * (new_tokens - 1) / (t(new_tokens) - t(1))`` as in
``harness.bench.decode``; times are medians of ``--repeats`` runs after one warm-up, the
two methods taking turns in every repeat. The warm-up gives the acceptance rate, tokens
per decode forward, and whether the speculative run's tokens equal the plain run's (they
should: greedy speculative decoding emits greedy's tokens). A script, not a test.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from harness.bench.decode import Rates
from harness.dtypes import DTYPES
from harness.models import LoadedModel, ModelNotFoundError, kv_layout, load_model
from harness.parsing import OneLineParser, fail, int_in, run_interruptible, thread_count
from harness.prompts import BUILTIN_PROMPTS, Messages, render_prompt
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.requests import Request
from harness.runtime.results import EngineResult
from harness.runtime.scheduler import Scheduling
from harness.tiny_models import tiny_llama
from impl import KVCacheManager
from spec import MAX_BLOCK_SIZE, blocks_for_tokens

PROG = "python -m harness.bench.speculation"

_FUNCTION = """def average(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0
    return total / count
"""

_PASSAGE = (
    "A paged KV cache splits each request's keys and values into fixed-size blocks. A "
    "block table maps the request's token positions to blocks in a shared pool, so memory "
    "is reserved one block at a time. When a request finishes, its blocks go back to a "
    "free queue and the next request can use them at once."
)

QUOTING_PROMPTS: tuple[Messages, ...] = (
    (
        (
            "user",
            "Rename the variable total to running_sum in this Python function and return "
            f"the whole function:\n\n{_FUNCTION}",
        ),
    ),
    (("user", f"Copy this passage out word for word:\n\n{_PASSAGE}"),),
    (
        (
            "user",
            "Correct the spelling in this paragraph and return it whole:\n\n"
            + _PASSAGE.replace("blocks", "blokcs"),
        ),
    ),
)

Run = Callable[[int], EngineResult]  # new_tokens -> the engine's result


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="HF directory or .gguf file")
    parser.add_argument(
        "--tiny", action="store_true", help="use the seeded tiny random Llama (smoke runs)"
    )
    parser.add_argument("--speculate", type=int_in(1), default=4, help="draft tokens per decode")
    parser.add_argument("--max-new-tokens", type=int_in(2), default=48)
    parser.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16)
    parser.add_argument(
        "--repeats", type=int_in(1), default=3, help="timed runs; the median is kept"
    )
    parser.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run both prompt sets with and without speculation and print one table."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    try:
        loaded = (
            tiny_llama(args.seed)
            if args.tiny
            else load_model(args.model, torch.device("cpu"), dtype)
        )
    except ModelNotFoundError as error:
        return fail(PROG, str(error))
    print(
        f"model {loaded.name}; cpu threads {torch.get_num_threads()}; new tokens "
        f"{args.max_new_tokens}; block size {args.block_size}; median of {args.repeats}; "
        "EOS ignored, no prefix caching"
    )
    print(
        f"{'prompts':<8} {'method':<7} {'batch':>5} {'decode tok/s':>12} {'vs plain':>9} "
        f"{'e2e tok/s':>9} {'accepted':>9} {'tok/fwd':>7} {'same':>5}"
    )
    for name, prompts in _prompt_sets(loaded, args.seed).items():
        runs: dict[str, Run] = {
            "plain": partial(_run, loaded, prompts, Scheduling(), args.block_size),
            f"spec {args.speculate}": partial(
                _run, loaded, prompts, Scheduling(speculate=args.speculate), args.block_size
            ),
        }
        _compare(name, runs, len(prompts), args.max_new_tokens, args.repeats)
        sys.stdout.flush()
    return 0


def _prompt_sets(loaded: LoadedModel, seed: int) -> dict[str, list[tuple[int, ...]]]:
    """The token ids of both sets (the tiny model has no tokenizer: a random text followed
    by a copy of it stands in for quoting, random tokens for chat)."""
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        vocab = loaded.model.config.vocab_size
        texts = [torch.randint(vocab, (24,), generator=generator).tolist() for _ in range(3)]
        return {
            "quoting": [tuple(text + text) for text in texts],
            "chat": [tuple(text) for text in texts],
        }
    tokenizer = loaded.tokenizer
    return {
        "quoting": [render_prompt(tokenizer, messages) for messages in QUOTING_PROMPTS],
        "chat": [render_prompt(tokenizer, messages) for messages in BUILTIN_PROMPTS[:3]],
    }


def _compare(name: str, runs: dict[str, Run], batch: int, new_tokens: int, repeats: int) -> None:
    """Warm each method up, time them taking turns, print a row each.

    NOTE: the methods alternate within every repeat, so a change in the machine's load
    (other jobs share it) slows both alike.
    """
    warm = {method: run(new_tokens) for method, run in runs.items()}
    full: dict[str, list[float]] = {method: [] for method in runs}
    first: dict[str, list[float]] = {method: [] for method in runs}
    for repeat in range(repeats):
        print(f"[bench] {name}: round {repeat + 1}/{repeats}", file=sys.stderr)
        for method, run in runs.items():
            full[method].append(_timed(run, new_tokens))
            first[method].append(_timed(run, 1))
    rates = {
        method: Rates(
            statistics.median(full[method]), statistics.median(first[method]), batch, new_tokens
        )
        for method in runs
    }
    plain = rates["plain"].decode
    plain_tokens = _tokens(warm["plain"])
    for method, method_rates in rates.items():
        counts = warm[method].speculation
        accepted = f"{counts.acceptance_rate:.3f}" if counts.proposed_drafts else "-"
        same = "yes" if _tokens(warm[method]) == plain_tokens else "no"
        print(
            f"{name:<8} {method:<7} {batch:>5} {method_rates.decode:>12.1f} "
            f"{method_rates.decode / plain:>8.2f}x {method_rates.end_to_end:>9.1f} "
            f"{accepted:>9} {counts.tokens_per_forward:>7.2f} {same:>5}"
        )


def _timed(run: Run, new_tokens: int) -> float:
    started = time.perf_counter()
    run(new_tokens)
    return time.perf_counter() - started


def _tokens(result: EngineResult) -> dict[str, list[int]]:
    return {request_id: output.token_ids for request_id, output in result.outputs.items()}


def _run(
    loaded: LoadedModel,
    prompts: list[tuple[int, ...]],
    scheduling: Scheduling,
    block_size: int,
    new_tokens: int,
) -> EngineResult:
    """All ``prompts`` at once through a fresh engine on a pool that holds them all."""
    total_blocks = sum(blocks_for_tokens(block_size, len(p) + new_tokens) for p in prompts)
    manager = KVCacheManager(total_blocks, block_size)
    pool = PagedKVPool(kv_layout(loaded), total_blocks, block_size)
    requests = [Request(f"r{i}", prompt, new_tokens) for i, prompt in enumerate(prompts)]
    engine = Engine(loaded.model, manager, pool, None, prefix_caching=False, scheduling=scheduling)
    return engine.run(requests)


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
