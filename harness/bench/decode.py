"""``python -m harness.bench.decode``: decode tokens/s and KV bytes, dense vs paged vs HF CB.

For each batch size, the same prompts (the built-in ones, cycled) run
- dense: a static batch through ``model.generate`` (left-padded, HF's dense cache);
- paged: this project's engine, all requests arriving at once (the same batch composition);
- hf-cb: transformers' own continuous batching, ``model.generate_batch``, if it runs here.
Every request decodes exactly ``--max-new-tokens`` tokens (EOS ignored). Decode tokens/s
is ``batch * (new_tokens - 1) / (t(new_tokens) - t(1))``: the time of a run that stops
after its first token (prefill) is subtracted; NaN when fixed overheads make t(1) >= t(n).
End-to-end tokens/s is ``batch * new_tokens / t(new_tokens)``. Times are medians of
``--repeats`` runs after one warm-up, the methods taking turns in every repeat. KV bytes:
dense = the padded cache, ``batch * (longest prompt + new tokens)`` tokens; paged = the
blocks in use at the peak.
It is a script, not a test.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from harness.cli.parsing import OneLineParser, fail
from harness.models import LoadedModel, ModelNotFoundError, kv_layout, load_model, tiny_llama
from harness.oracle.dense import generate_dense_batch
from harness.prompts import BUILTIN_PROMPTS, render_prompt
from harness.runtime.engine import NO_PREFIX_CACHING, Engine, Request
from harness.runtime.kv_pool import PagedKVPool
from impl import KVBlockManager
from spec import blocks_for_tokens

PROG = "python -m harness.bench.decode"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="HF directory or .gguf file")
    parser.add_argument(
        "--tiny", action="store_true", help="use the seeded tiny random Llama (smoke runs)"
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--methods",
        default="dense,paged,hf-cb",
        help="comma-separated subset of dense,paged,hf-cb (dense always runs: it is the baseline)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one table."""
    args = build_parser().parse_args(argv)
    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        return fail(PROG, f"--batch-sizes must be integers, got {args.batch_sizes!r}")
    if min(batch_sizes) < 1 or args.max_new_tokens < 2 or args.repeats < 1:
        return fail(PROG, "batch sizes and --repeats must be >= 1, --max-new-tokens >= 2")
    methods = set(args.methods.split(","))
    if not methods <= {"dense", "paged", "hf-cb"}:
        return fail(PROG, f"--methods must name dense, paged or hf-cb, got {args.methods!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        loaded = (
            tiny_llama(args.seed)
            if args.tiny
            else load_model(args.model, torch.device("cpu"), torch.float32)
        )
    except ModelNotFoundError as error:
        return fail(PROG, str(error))
    prompts = _prompts(loaded, max(batch_sizes), args.seed)
    layout = kv_layout(loaded)
    print(
        f"model {loaded.name}; cpu threads {torch.get_num_threads()}; new tokens "
        f"{args.max_new_tokens}; block size {args.block_size}; median of {args.repeats}"
    )
    print(
        f"{'method':<7} {'batch':>5} {'decode tok/s':>12} {'vs dense':>9} {'e2e tok/s':>9} "
        f"{'run s':>7} {'KV MiB':>8}"
    )
    for batch_size in batch_sizes:
        batch = prompts[:batch_size]
        peak: list[int] = []
        runs: dict[str, Callable[[int], None]] = {"dense": partial(_run_dense, loaded, batch)}
        if "paged" in methods:
            runs["paged"] = partial(
                _run_paged, loaded, batch, block_size=args.block_size, peak=peak
            )
        if "hf-cb" in methods:
            runs["hf-cb"] = partial(_run_generate_batch, loaded, batch)
        rates = _measure(runs, batch_size, args)
        kv_tokens = {
            "dense": batch_size * (max(map(len, batch)) + args.max_new_tokens),
            "paged": max(peak, default=0) * args.block_size,
        }
        for method, method_rates in rates.items():
            if method in methods:
                tokens = kv_tokens.get(method)
                kv_bytes = None if tokens is None else tokens * layout.bytes_per_token
                _row(method, batch_size, method_rates, kv_bytes, rates["dense"])
        sys.stdout.flush()
    return 0


def _prompts(loaded: LoadedModel, count: int, seed: int) -> list[tuple[int, ...]]:
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        vocab = loaded.model.config.vocab_size
        return [
            tuple(int(t) for t in torch.randint(vocab, (20 + 7 * (i % 5),), generator=generator))
            for i in range(count)
        ]
    rendered = [render_prompt(loaded.tokenizer, messages) for messages in BUILTIN_PROMPTS]
    return [rendered[i % len(rendered)] for i in range(count)]


@dataclass(frozen=True, slots=True)
class Rates:
    """Median seconds of a full run and of a first-token-only run, and the rates from them."""

    full_s: float
    first_s: float
    batch_size: int
    new_tokens: int

    @property
    def decode(self) -> float:
        """Decode tokens/s; NaN when the first-token run was not faster (fixed overheads)."""
        if self.full_s <= self.first_s:
            return float("nan")
        return self.batch_size * (self.new_tokens - 1) / (self.full_s - self.first_s)

    @property
    def end_to_end(self) -> float:
        """Generated tokens/s over the whole run, prefill included."""
        return self.batch_size * self.new_tokens / self.full_s


def _measure(
    runs: dict[str, Callable[[int], None]], batch_size: int, args: argparse.Namespace
) -> dict[str, Rates]:
    """Median full-run and first-token-run times of every method, measured round-robin.

    NOTE: the methods take turns within each repeat (dense, paged, ..., then again), so a
    change in the machine's load during the benchmark slows all of them alike instead of
    landing on whichever method happened to run then. A method that fails its warm-up
    (``hf-cb`` where transformers cannot run it) is reported and left out.
    """
    new_tokens: int = args.max_new_tokens
    working: dict[str, Callable[[int], None]] = {}
    for method, run in runs.items():
        try:
            run(new_tokens)  # warm-up
        except Exception as error:
            if method == "dense":
                raise
            print(f"{method:<7} {batch_size:>5} did not run: {type(error).__name__}: {error}"[:200])
        else:
            working[method] = run
    full: dict[str, list[float]] = {method: [] for method in working}
    first: dict[str, list[float]] = {method: [] for method in working}
    for repeat in range(args.repeats):
        print(f"[bench] batch {batch_size}: round {repeat + 1}/{args.repeats}", file=sys.stderr)
        for method, run in working.items():
            full[method].append(_timed(run, new_tokens))
            first[method].append(_timed(run, 1))
    return {
        method: Rates(
            statistics.median(full[method]),
            statistics.median(first[method]),
            batch_size,
            new_tokens,
        )
        for method in working
    }


def _timed(run: Callable[[int], None], new_tokens: int) -> float:
    started = time.perf_counter()
    run(new_tokens)
    return time.perf_counter() - started


def _run_dense(loaded: LoadedModel, batch: list[tuple[int, ...]], new_tokens: int) -> None:
    pad = loaded.eos_token_id if loaded.eos_token_id is not None else 0
    generate_dense_batch(loaded.model, batch, new_tokens, pad)


def _run_paged(
    loaded: LoadedModel,
    batch: list[tuple[int, ...]],
    new_tokens: int,
    *,
    block_size: int,
    peak: list[int],
) -> None:
    num_blocks = sum(blocks_for_tokens(block_size, len(p) + new_tokens) for p in batch)
    manager = KVBlockManager(num_blocks, block_size)
    pool = PagedKVPool(kv_layout(loaded), num_blocks, block_size)
    requests = [Request(f"r{i}", prompt, new_tokens) for i, prompt in enumerate(batch)]
    # NOTE: no prefix caching, so the engine prefills what the dense batch prefills.
    result = Engine(loaded.model, manager, pool, None, NO_PREFIX_CACHING).run(requests)
    peak.append(result.peak_used_blocks)


def _run_generate_batch(loaded: LoadedModel, batch: list[tuple[int, ...]], new_tokens: int) -> None:
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.eos_token_id if loaded.eos_token_id is not None else 0,
    )
    model: Any = loaded.model  # Any: a transformers causal LM
    outputs = model.generate_batch([list(p) for p in batch], generation_config=config)
    if len(outputs) != len(batch):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(batch)} requests")


def _row(method: str, batch_size: int, rates: Rates, kv_bytes: int | None, dense: Rates) -> None:
    kv = "-" if kv_bytes is None else f"{kv_bytes / 2**20:.2f}"
    print(
        f"{method:<7} {batch_size:>5} {rates.decode:>12.1f} {rates.decode / dense.decode:>8.2f}x "
        f"{rates.end_to_end:>9.1f} {rates.full_s:>7.2f} {kv:>8}"
    )


if __name__ == "__main__":
    sys.exit(main())
