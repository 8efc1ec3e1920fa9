"""``python -m harness.bench.decode``: decode tokens/s and KV bytes, dense vs paged vs HF CB.

For each batch size, the same prompts (the built-in ones, cycled) run
- dense: a static batch through ``model.generate`` (left-padded, HF's dense cache);
- paged: this project's engine, all requests arriving at once (the same batch composition),
  its attention computed by ``--attention`` (gather by default; see ``python -m harness``);
- hf-cb: transformers' own continuous batching, ``model.generate_batch``, with an explicit
  ``ContinuousBatchingConfig`` (below), if it runs here.
Every request decodes exactly ``--max-new-tokens`` tokens (EOS ignored). Decode tokens/s
is ``batch * (new_tokens - 1) / (t(new_tokens) - t(1))``: the time of a run that stops
after its first token (prefill) is subtracted; NaN when fixed overheads make t(1) >= t(n).
End-to-end tokens/s is ``batch * new_tokens / t(new_tokens)``. Times are medians of
``--repeats`` runs after one warm-up, the methods taking turns in every repeat; on CUDA
every timed region starts and ends with ``torch.cuda.synchronize``. KV bytes: dense = the
padded cache, ``batch * (longest prompt + new tokens)`` tokens; paged = the blocks in use
at the peak; hf-cb = the blocks its config gives it.

The warm-up's tokens are compared: the ``tokens`` column counts the requests whose tokens
equal the paged engine's (a difference is a batched near-tie flip, not a failure here:
``python -m harness`` is the check).
It is a script, not a test.
"""

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from harness.bench.attention import timed
from harness.bench.decode_methods import (
    hf_cb_config_text,
    hf_cb_num_blocks,
    run_dense,
    run_generate_batch,
    run_paged,
)
from harness.dtypes import DTYPES
from harness.models import LoadedModel, ModelNotFoundError, kv_layout, load_model
from harness.output_files import write_replacing
from harness.parsing import OneLineParser, fail, int_in, run_interruptible, thread_count
from harness.prompts import BUILTIN_PROMPTS, render_prompt
from harness.runtime.attention_backends import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionBackendError,
)
from harness.runtime.sdpa_order import describe_order, harness_sdpa_order
from harness.tiny_models import tiny_llama
from spec import MAX_BLOCK_SIZE

PROG = "python -m harness.bench.decode"

Run = Callable[[int], list[list[int]]]  # new_tokens -> each request's tokens


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="HF directory or .gguf file")
    parser.add_argument(
        "--tiny", action="store_true", help="use the seeded tiny random Llama (smoke runs)"
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--max-new-tokens", type=int_in(2), default=32)
    parser.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16)
    parser.add_argument(
        "--repeats", type=int_in(1), default=3, help="timed runs; the median is kept"
    )
    parser.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON"
    )
    parser.add_argument(
        "--machine", default=None, help="how to name this machine in the JSON (default: guessed)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention",
        choices=sorted(ATTENTION_BACKENDS),
        default="gather",
        help="the paged engine's attention (default gather)",
    )
    parser.add_argument(
        "--methods",
        default="dense,paged,hf-cb",
        help="comma-separated subset of dense,paged,hf-cb (dense always runs: it is the baseline)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one table (and write the JSON when asked)."""
    args = build_parser().parse_args(argv)
    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        return fail(PROG, f"--batch-sizes must be integers, got {args.batch_sizes!r}")
    if min(batch_sizes) < 1:
        return fail(PROG, f"--batch-sizes must be >= 1, got {args.batch_sizes!r}")
    methods = set(args.methods.split(","))
    if not methods <= {"dense", "paged", "hf-cb"}:
        return fail(PROG, f"--methods must name dense, paged or hf-cb, got {args.methods!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail(PROG, "--device cuda given but no CUDA device is available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    try:
        loaded = (
            _tiny(args.seed, device, dtype) if args.tiny else load_model(args.model, device, dtype)
        )
    except ModelNotFoundError as error:
        return fail(PROG, str(error))
    attention = ATTENTION_BACKENDS[args.attention]
    try:
        attention.check(loaded.model, kv_layout(loaded), args.block_size)
    except AttentionBackendError as error:
        return fail(PROG, str(error))
    settings = Settings(
        batch_sizes, args.max_new_tokens, args.block_size, args.repeats, methods, attention
    )
    rows = run_benchmark(loaded, _prompts(loaded, max(batch_sizes), args.seed), settings)
    if args.json is not None:
        document = json.dumps(as_json(rows, loaded, args.machine), indent=2) + "\n"
        # Whole or not at all: Ctrl-C or a full disk leaves no half-written JSON.
        write_replacing(args.json, lambda file: file.write_text(document))
    return 0


@dataclass(frozen=True, slots=True)
class Settings:
    """What to run: batch sizes, new tokens per request, block size, repeats, methods, and
    the paged engine's attention."""

    batch_sizes: list[int]
    max_new_tokens: int
    block_size: int
    repeats: int
    methods: set[str]
    attention: AttentionBackend = ATTENTION_BACKENDS["gather"]


@dataclass(frozen=True, slots=True)
class Row:
    """One method at one batch size: its rates, the dense baseline's, and token agreement."""

    method: str
    batch_size: int
    rates: "Rates"
    dense: "Rates"
    kv_bytes: int
    same_tokens: int  # requests whose tokens equal the paged engine's (or dense's)

    @property
    def decode_ratio_vs_dense(self) -> float:
        """Decode tokens/s relative to dense ``generate`` at the same batch size."""
        return self.rates.decode / self.dense.decode


def run_benchmark(
    loaded: LoadedModel, prompts: list[tuple[int, ...]], settings: Settings
) -> list[Row]:
    """Every method at every batch size; prints the table as it goes and returns its rows."""
    layout = kv_layout(loaded)
    device = next(loaded.model.parameters()).device
    print(
        f"model {loaded.name}; {_device_name(device)}, "
        f"{str(layout.dtype).removeprefix('torch.')}; cpu threads {torch.get_num_threads()}; "
        f"new tokens {settings.max_new_tokens}; block size {settings.block_size}; "
        f"median of {settings.repeats}; paged attention: {settings.attention.name}; "
        f"{_sdpa_order_text(device)}"
        f"hf-cb: {hf_cb_config_text(settings.block_size)}"
    )
    print(
        f"{'method':<7} {'batch':>5} {'decode tok/s':>12} {'vs dense':>9} {'e2e tok/s':>9} "
        f"{'run s':>7} {'KV MiB':>8} {'tokens':>7}"
    )
    rows: list[Row] = []
    for batch_size in settings.batch_sizes:
        batch = prompts[:batch_size]
        peak: list[int] = []
        runs: dict[str, Run] = {"dense": partial(run_dense, loaded, batch)}
        if "paged" in settings.methods:
            runs["paged"] = partial(
                run_paged,
                loaded,
                batch,
                block_size=settings.block_size,
                peak=peak,
                attention=settings.attention,
            )
        if "hf-cb" in settings.methods:
            runs["hf-cb"] = partial(
                run_generate_batch, loaded, batch, block_size=settings.block_size
            )
        with harness_sdpa_order(device):  # every method alike: cuDNN's attention last
            rates, tokens = _measure(runs, batch_size, settings, device)
        new_tokens = settings.max_new_tokens
        kv_tokens = {
            "dense": batch_size * (max(map(len, batch)) + new_tokens),
            "paged": max(peak, default=0) * settings.block_size,
            "hf-cb": hf_cb_num_blocks(batch, new_tokens, settings.block_size) * settings.block_size,
        }
        compare_to = tokens.get("paged", tokens["dense"])
        for method, method_rates in rates.items():
            if method in settings.methods:
                same = sum(
                    ours == theirs for ours, theirs in zip(tokens[method], compare_to, strict=True)
                )
                row = Row(
                    method,
                    batch_size,
                    method_rates,
                    rates["dense"],
                    kv_tokens[method] * layout.bytes_per_token,
                    same,
                )
                _print_row(row)
                rows.append(row)
        sys.stdout.flush()
    return rows


def as_json(rows: list[Row], loaded: LoadedModel, machine: str | None) -> dict[str, object]:
    """The rows in the schema the plot script reads (nothing more: it reads exactly this)."""
    import transformers  # noqa: PLC0415 (only for its version)

    parameter = next(loaded.model.parameters())
    return {
        "machine": machine or _guess_machine(parameter.device),
        "device": parameter.device.type,
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": [
            {
                "method": row.method,
                "batch_size": row.batch_size,
                "decode_tok_s": row.rates.decode,
                "e2e_tok_s": row.rates.end_to_end,
                "decode_ratio_vs_dense": row.decode_ratio_vs_dense,
            }
            for row in rows
        ],
    }


def _tiny(seed: int, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    loaded = tiny_llama(seed)
    # A smoke model: cast after building (its rotary frequencies round too; nothing is
    # compared with HF's own bf16 here).
    loaded.model.to(device=device, dtype=dtype)
    return loaded


def _sdpa_order_text(device: torch.device) -> str:
    return f"sdpa order {describe_order()}; " if device.type == "cuda" else ""


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def _guess_machine(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    return f"{os.cpu_count()}-core {platform.machine()}, {gpu}"


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
    runs: dict[str, Run], batch_size: int, settings: Settings, device: torch.device
) -> tuple[dict[str, Rates], dict[str, list[list[int]]]]:
    """Median full-run and first-token-run times of every method, measured round-robin,
    and each method's tokens from its warm-up run.

    NOTE: the methods take turns within each repeat (dense, paged, ..., then again), so a
    change in the machine's load during the benchmark slows all of them alike instead of
    landing on whichever method happened to run then. A method that fails its warm-up
    (``hf-cb`` where transformers cannot run it) is reported and left out.
    """
    new_tokens = settings.max_new_tokens
    working: dict[str, Run] = {}
    tokens: dict[str, list[list[int]]] = {}
    for method, run in runs.items():
        try:
            tokens[method] = run(new_tokens)  # warm-up
        except Exception as error:
            if method == "dense":
                raise
            print(f"{method:<7} {batch_size:>5} did not run: {type(error).__name__}: {error}"[:200])
        else:
            working[method] = run
    full: dict[str, list[float]] = {method: [] for method in working}
    first: dict[str, list[float]] = {method: [] for method in working}
    for repeat in range(settings.repeats):
        print(f"[bench] batch {batch_size}: round {repeat + 1}/{settings.repeats}", file=sys.stderr)
        for method, run in working.items():
            full[method].append(timed(partial(run, new_tokens), device))
            first[method].append(timed(partial(run, 1), device))
    rates = {
        method: Rates(
            statistics.median(full[method]),
            statistics.median(first[method]),
            batch_size,
            new_tokens,
        )
        for method in working
    }
    return rates, tokens


def _print_row(row: Row) -> None:
    kv = f"{row.kv_bytes / 2**20:.2f}"
    rates = row.rates
    print(
        f"{row.method:<7} {row.batch_size:>5} {rates.decode:>12.1f} "
        f"{row.decode_ratio_vs_dense:>8.2f}x {rates.end_to_end:>9.1f} {rates.full_s:>7.2f} "
        f"{kv:>8} {row.same_tokens:>3}/{row.batch_size:<3}"
    )


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
