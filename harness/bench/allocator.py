"""Allocator throughput on a synthetic ShareGPT-like serving trace: impl, and spec for scale.

``python -m harness.bench.allocator`` replays a fixed-seed trace (``harness.bench.traces``)
through a continuous-batching scheduler that only does allocator work (no model;
``harness.bench.replay``): admit first-come-first-served while blocks allow, one decode
append per running request per step, release on finish, and preempt the most recently
admitted request by recompute when a decode append finds no free block. It times the
allocator calls of each phase: impl's ``KVCacheManager.append`` (the engine's decode call),
the article layer's ``append_slot`` and ``append_tokens``, and the article-style baseline
(``harness.bench.article_manager``), and prints medians over runs; then the in-block
append table, the prefix tables (``harness.bench.prefix``) and the sliding-window table
(``harness.bench.window_table``).
"""

import statistics
import sys
import time
from collections.abc import Callable, Sequence

from harness.bench.article_manager import Allocator, ArticleStyleManager
from harness.bench.prefix import (
    PREFIX_TABLE_HEADER,
    prefix_heavy_trace,
    revival_trace,
    run_prefix_trace,
)
from harness.bench.replay import RunTimes, timed_runs
from harness.bench.traces import TraceRequest, make_trace
from harness.bench.window_table import print_window_table
from harness.parsing import OneLineParser, fail, int_in, run_interruptible
from impl import KVBlockManager, KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS, blocks_for_tokens

PROG = "python -m harness.bench.allocator"


# The in-block appends timed in a tight loop: the table's ``append`` of a count and of one
# token id (``KVCacheManager``, the engine's call), the article layer's two (by count).
IN_BLOCK_METHODS = ("append", "append token id", "append_slot", "append_tokens")


def in_block_append_ns(method: str, repeats: int, appends: int) -> float:
    """Median ns of one in-block append by ``method`` (``IN_BLOCK_METHODS``)."""
    block_size = 16
    requests = appends // (block_size - 1)
    samples = []
    for _ in range(repeats):
        table = KVCacheManager(requests + 1, block_size)
        article = KVBlockManager(requests + 1, block_size)
        request_ids = [f"r{i}" for i in range(requests)]
        for request_id in request_ids:
            # One token: 15 in-block appends left.
            if method == "append token id":
                table.allocate(request_id, [1])
            elif method == "append":
                table.allocate(request_id, 1)
            else:
                article.allocate(request_id, 1)
        start = time.perf_counter_ns()
        if method == "append token id":
            # A loop of its own: unpacking an argument tuple per call would cost ~80 ns.
            append_ids = table.append
            token = (7,)
            for request_id in request_ids:
                for _ in range(block_size - 1):
                    append_ids(request_id, token)
        else:
            manager = table if method == "append" else article
            append: Callable[[str], object] = getattr(manager, method)
            for request_id in request_ids:
                for _ in range(block_size - 1):
                    append(request_id)
        samples.append((time.perf_counter_ns() - start) / (requests * (block_size - 1)))
    return statistics.median(samples)


def summarize(name: str, results: Sequence[RunTimes], trace: Sequence[TraceRequest]) -> str:
    """One table row: medians over the runs."""
    first = results[0]
    generated = sum(r.output_tokens for r in trace)

    def med(per_run: Callable[[RunTimes], float]) -> float:
        return statistics.median(per_run(r) for r in results)

    return (
        f"| {name} | {len(trace):,} | {first.steps:,} | {first.preemptions:,} "
        f"| {med(lambda r: r.admit_ns / max(1, r.admits)):,.0f} "
        f"| {med(lambda r: r.decode_ns / max(1, r.appends)):,.0f} "
        f"| {med(lambda r: r.release_ns / max(1, r.releases)):,.0f} "
        f"| {med(lambda r: r.total_ns / generated / 1000):.3f} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=PROG,
        description=(
            "Time the allocator alone on a fixed-seed ShareGPT-like trace under a "
            "continuous-batching scheduler (FCFS admission, one decode append per running "
            "request per step, release on finish, preemption by recompute). Prints medians "
            "over --runs replays after one warm-up replay."
        ),
    )
    parser.add_argument("--requests", type=int_in(1), default=10_000, help="requests in the trace")
    parser.add_argument("--spec-requests", type=int_in(1), default=200, help="requests for spec")
    parser.add_argument(
        "--total-blocks", type=int_in(1, MAX_TOTAL_BLOCKS), default=8192, help="blocks in the pool"
    )
    parser.add_argument(
        "--spec-total-blocks",
        type=int_in(1, MAX_TOTAL_BLOCKS),
        default=1024,
        help="blocks for spec",
    )
    parser.add_argument(
        "--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16, help="tokens per block"
    )
    parser.add_argument("--max-running", type=int_in(1), default=256, help="most running requests")
    parser.add_argument("--runs", type=int_in(1), default=5, help="timed replays (median taken)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--skip-spec", action="store_true", help="time impl only")
    parser.add_argument(
        "--window-requests",
        type=int_in(0),
        default=2_000,
        help="requests of the ShareGPT-like trace in the sliding-window table (0 skips it)",
    )
    parser.add_argument(
        "--long-requests", type=int_in(1), default=48, help="requests of the long-context trace"
    )
    parser.add_argument(
        "--long-max-running", type=int_in(1), default=16, help="most running long-context requests"
    )
    parser.add_argument(
        "--window-total-blocks",
        type=int_in(1, MAX_TOTAL_BLOCKS),
        default=262_144,
        help="blocks in the sliding-window table's pools",
    )
    parser.add_argument(
        "--prefix-requests",
        type=int_in(0),
        default=2_000,
        help="requests in each prefix-caching trace (0 skips them)",
    )
    args = parser.parse_args(argv)
    trace = make_trace(args.requests, args.seed)
    prompts = sorted(r.prompt_tokens for r in trace)
    outputs = sorted(r.output_tokens for r in trace)
    longest = max(r.prompt_tokens + r.output_tokens for r in trace)
    if blocks_for_tokens(args.block_size, longest) > args.total_blocks:
        return fail(PROG, f"a request of {longest} tokens cannot fit {args.total_blocks} blocks")
    print(
        f"trace: {len(trace):,} requests, seed {args.seed}; prompt tokens mean "
        f"{statistics.mean(prompts):.0f} p99 {prompts[int(0.99 * len(prompts))]}; output "
        f"tokens mean {statistics.mean(outputs):.0f} p99 {outputs[int(0.99 * len(outputs))]}"
    )
    blocks = f"{args.total_blocks:,} blocks"

    def impl() -> Allocator:
        return KVCacheManager(args.total_blocks, args.block_size)

    def article_layer() -> Allocator:
        return KVBlockManager(args.total_blocks, args.block_size)

    def article() -> Allocator:
        return ArticleStyleManager(args.total_blocks, args.block_size)

    methods = {
        f"impl append, {blocks}": (impl, "append"),
        f"impl article layer append_slot, {blocks}": (article_layer, "append_slot"),
        f"impl article layer append_tokens, {blocks}": (article_layer, "append_tokens"),
        f"article-style append_tokens, {blocks}": (article, "append_tokens"),
    }
    results = timed_runs(methods, trace, args.max_running, args.runs)
    rows = [summarize(name, runs, trace) for name, runs in results.items()]
    if not args.skip_spec:
        spec_trace = make_trace(args.spec_requests, args.seed)
        name = f"spec append, {args.spec_total_blocks:,} blocks"

        def spec_backed() -> Allocator:
            manager: Allocator = SpecBackedManager(args.spec_total_blocks, args.block_size)
            return manager

        spec_runs = timed_runs(
            {name: (spec_backed, "append")},
            spec_trace,
            args.max_running,
            max(1, args.runs // 2),
        )
        rows.append(summarize(name, spec_runs[name], spec_trace))
    print(
        "| allocator | requests | steps | preemptions | ns/admit | ns/decode append "
        "| ns/release | us allocator per generated token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    sys.stdout.flush()
    for method in IN_BLOCK_METHODS:
        median_ns = in_block_append_ns(method, repeats=7, appends=200_000)
        print(f"median in-block decode append, impl {method}, tight loop: {median_ns:.0f} ns")
    if args.prefix_requests > 0:
        print_prefix_tables(args.prefix_requests, args.seed)
    if args.window_requests > 0:
        print_window_table(args, args.window_requests, args.long_requests)
    return 0


def print_prefix_tables(request_count: int, seed: int) -> None:
    """The prefix-heavy trace, and the revival trace at three pool sizes."""
    rows = []
    print("  prefix-heavy trace", file=sys.stderr, flush=True)
    heavy = prefix_heavy_trace(request_count, seed)
    rows.append(run_prefix_trace("prefix-heavy", heavy, 8192, 256, seed))
    revival = revival_trace(request_count, seed)
    for total_blocks in (8_192, 32_768, 131_072):
        print(f"  revival trace, {total_blocks} blocks", file=sys.stderr, flush=True)
        rows.append(run_prefix_trace("revival", revival, total_blocks, 4, seed))
    print(PREFIX_TABLE_HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
