"""``python -m harness.bench.preemption``: what a preemption costs, by swap and by recompute.

The main command's requests (the 14 built-in chat prompts through the chat template, or
seeded token ids with ``--tiny``), ``--max-new-tokens`` each, ``--arrival-gap`` steps
apart, through the paged engine with prefix caching, three ways, taking turns in every
run after one warm-up each:
- ``roomy``: a pool that holds every request at once, so nothing is preempted;
- ``recompute``: a tight pool (the main command's default, a quarter of what all need at
  once), victims recomputed;
- ``swap``: the same tight pool and a host tier as large, victims swapped out and back.
Per configuration: preemptions, tokens recomputed, blocks and bytes moved each way, the
median run time, the time in preemptions and swaps (``HostTierCounts.swap_s``, a swap's
whole cost), and per preemption the time a recompute costs more than a swap on the same
pool (median run time difference / recompute preemptions: the prefill of what it dropped,
less the swap's copies). ``roomy`` shows what the tight pool costs besides preemption
(smaller batches).
Only the batched run is timed: no dense reference, no checks (``python -m harness
--preempt swap`` checks the same runs).
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.limits import available_bytes, check_memory, check_options
from harness.models import LoadedModel, ModelNotFoundError, kv_layout, load_model
from harness.oracle.device_cases import staggered_requests
from harness.oracle.equivalence import tight_total_blocks
from harness.parsing import OneLineParser, fail, int_in, run_interruptible, thread_count
from harness.prompts import BUILTIN_PROMPTS, render_prompt
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, new_manager
from harness.runtime.preemption import PreemptMode
from harness.runtime.requests import Request
from harness.runtime.results import EngineResult
from harness.settings import CheckSettingsError
from harness.tiny_models import tiny_llama
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS

PROG = "python -m harness.bench.preemption"


@dataclass(frozen=True, slots=True)
class Config:
    """One way to run the requests: the pool's blocks, the host tier's, how to preempt."""

    name: str
    total_blocks: int
    host_blocks: int
    preemption: PreemptMode


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="The cost of a preemption by swap and by recompute on the main "
        "command's requests: each way's median run time against a pool with no preemption, "
        "the methods taking turns after a warm-up.",
    )
    parser.add_argument("--tiny", action="store_true", help="the seeded tiny model (smoke)")
    parser.add_argument(
        "--threads", type=thread_count, default=1, help="torch CPU threads (default 1)"
    )
    parser.add_argument(
        "--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16, help="tokens per block"
    )
    parser.add_argument(
        "--max-new-tokens", type=int_in(1), default=64, help="new tokens per request"
    )
    parser.add_argument("--arrival-gap", type=int_in(0), default=2, help="steps between arrivals")
    parser.add_argument(
        "--total-blocks",
        type=int_in(1, MAX_TOTAL_BLOCKS),
        default=None,
        help="the tight pool (default: a quarter)",
    )
    parser.add_argument("--runs", type=int_in(1), default=3, help="timed runs (median taken)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the three configurations in turns and print one table."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        loaded = (
            tiny_llama(0) if args.tiny else load_model(None, torch.device("cpu"), torch.float32)
        )
    except ModelNotFoundError as error:
        return fail(PROG, str(error))
    requests = _requests(loaded, args.max_new_tokens, args.arrival_gap)
    layout = kv_layout(loaded)
    groups = len(layout.group_windows)
    roomy = sum(request.blocks_needed(args.block_size, groups) for request in requests)
    tight = args.total_blocks
    if tight is None:
        tight = tight_total_blocks(requests, args.block_size, groups)
    if tight < max(request.blocks_needed(args.block_size, groups) for request in requests):
        return fail(PROG, f"--total-blocks {tight} cannot hold even the largest request")
    configs = [
        Config("roomy", roomy, 0, "recompute"),
        Config("recompute", tight, 0, "recompute"),
        Config("swap", tight, tight, "swap"),
    ]
    try:  # what the main command refuses, before a pool is built
        check_options(loaded.model, args.block_size, args.max_new_tokens, 1)
        available = available_bytes(layout.device)
        for config in configs:
            blocks, host = config.total_blocks, config.host_blocks
            check_memory(requests, blocks, args.block_size, layout, available, host_blocks=host)
    except CheckSettingsError as error:
        return fail(PROG, error.naming_the_option())

    def run(config: Config) -> EngineResult:
        return _run(loaded, requests, args.block_size, config)

    results = _in_turns(configs, run, args.runs)
    _print_table(loaded, requests, args.block_size, configs, results)
    return 0


def _requests(loaded: LoadedModel, max_new_tokens: int, arrival_gap: int) -> list[Request]:
    """The main command's requests, or seeded token-id ones without a tokenizer."""
    if loaded.tokenizer is None:
        vocab = loaded.model.config.vocab_size
        return staggered_requests(14, vocab, max_new_tokens, arrival_gap, seed=1)
    return [
        Request(
            f"r{number:02d}",
            render_prompt(loaded.tokenizer, messages),
            max_new_tokens,
            arrival_step=number * arrival_gap,
        )
        for number, messages in enumerate(BUILTIN_PROMPTS)
    ]


def _run(
    loaded: LoadedModel, requests: list[Request], block_size: int, config: Config
) -> EngineResult:
    layout = kv_layout(loaded)
    manager = new_manager(layout, config.total_blocks, block_size, host_blocks=config.host_blocks)
    pool = PagedKVPool(layout, config.total_blocks, block_size, config.host_blocks)
    engine = Engine(loaded.model, manager, pool, loaded.eos_token_id, preemption=config.preemption)
    return engine.run(requests)


def _in_turns(
    configs: list[Config], run: Callable[[Config], EngineResult], runs: int
) -> dict[str, list[EngineResult]]:
    """One warm-up run per configuration, then ``runs`` runs, the configurations taking
    turns in each (a change of load hits them alike); progress on stderr."""
    for config in configs:
        print(f"  {config.name}: warm-up", file=sys.stderr, flush=True)
        run(config)
    results: dict[str, list[EngineResult]] = {config.name: [] for config in configs}
    for number in range(runs):
        for config in configs:
            print(f"  {config.name}: run {number + 1}/{runs}", file=sys.stderr, flush=True)
            results[config.name].append(run(config))
    return results


def _print_table(
    loaded: LoadedModel,
    requests: list[Request],
    block_size: int,
    configs: list[Config],
    results: dict[str, list[EngineResult]],
) -> None:
    block_mib = block_size * kv_layout(loaded).bytes_per_block_token / 2**20
    swap_s = statistics.median(result.elapsed_s for result in results["swap"])
    print(
        f"model {loaded.name}; {len(requests)} requests; blocks of {block_size} tokens "
        f"({block_mib * 1024:,.0f} KiB); medians of {len(results['roomy'])} runs"
    )
    print(
        "| preemption | pool blocks | host blocks | preemptions (swap / recompute) "
        "| tokens recomputed | blocks to host / back (MiB) | run s | ms in preemptions and "
        "swaps | ms per preemption more than swap |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        first = results[config.name][0]
        host = first.host
        run_s = statistics.median(result.elapsed_s for result in results[config.name])
        swap_ms = statistics.median(result.host.swap_s for result in results[config.name]) * 1e3
        extra = f"{(run_s - swap_s) * 1e3 / host.recomputes:,.0f}" if host.recomputes else "-"
        moved = host.blocks_to_host + host.blocks_to_device
        print(
            f"| {config.name} | {config.total_blocks} | {config.host_blocks} "
            f"| {host.swaps_out} / {host.recomputes} | {host.recomputed_tokens} "
            f"| {host.blocks_to_host} / {host.blocks_to_device} ({moved * block_mib:.1f}) "
            f"| {run_s:.2f} | {swap_ms:.1f} | {extra} |"
        )


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
