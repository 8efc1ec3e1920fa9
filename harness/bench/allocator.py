"""Allocator throughput on a synthetic ShareGPT-like serving trace: impl, and spec for scale.

``python -m harness.bench.allocator`` replays a fixed-seed trace through a continuous-
batching scheduler that only does allocator work (no model): admit first-come-first-served
while blocks allow, one decode append per running request per step, release on finish,
and preempt the most recently admitted request by recompute when a decode append finds
no free block. It times the allocator calls of each phase and prints medians over runs.

The trace's shape follows ShareGPT-style serving benchmarks: lognormal prompt lengths
(mean ~160 tokens, p99 ~1,000) and output lengths (mean ~330, p99 ~1,800).

The sliding-window table replays that trace and a long-context one (prompts of 8k-32k
tokens, 1k-8k generated) on pools with KV cache groups: a 4,096-token window alone
(Mistral-like) and beside a full-attention group (Gemma-like), against full attention
with as many groups; it reports the KV blocks held at the peak and the per-token cost.
"""

import argparse
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from harness.bench.prefix import (
    PREFIX_TABLE_HEADER,
    prefix_heavy_trace,
    revival_trace,
    run_prefix_trace,
)
from harness.cli.parsing import OneLineParser, fail, run_interruptible
from impl import BlockAllocationError, KVBlockManager, RequestBlockTable, SpecBackedManager

PROG = "python -m harness.bench.allocator"

# Lognormal (mu, sigma) solved from mean = exp(mu + sigma^2 / 2), p99 = exp(mu + 2.326 sigma).
PROMPT_MU, PROMPT_SIGMA = 4.570, 1.005  # mean ~160, p99 ~1,000 tokens
OUTPUT_MU, OUTPUT_SIGMA = 5.389, 0.906  # mean ~330, p99 ~1,800 tokens
MAX_TOKENS = 4096


class Allocator(Protocol):
    """The allocator calls a scheduler makes, as impl spells them."""

    @property
    def total_blocks(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    def can_allocate(self, token_count: int) -> bool: ...
    def allocate(self, request_id: str, token_count: int) -> object: ...
    def append_slot(self, request_id: str) -> int: ...
    def append_tokens(self, request_id: str, token_count: int = 1) -> object: ...
    def release(self, request_id: str) -> list[int]: ...


class ArticleStyleManager:
    """A baseline that behaves as the article series' manager does, written here to time
    it beside impl in one run: list tables, a deque free list, every call returning a
    copied snapshot, release in table order, no ref counts and no prefix cache."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(total_blocks))
        self.request_tables: dict[str, RequestBlockTable] = {}

    @property
    def free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_allocate(self, token_count: int) -> bool:
        return math.ceil(token_count / self.block_size) <= len(self.free_block_ids)

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        if request_id in self.request_tables:
            raise ValueError(f"request already has allocated blocks: {request_id}")
        needed = math.ceil(token_count / self.block_size)
        self._ensure_free(needed)
        taken = [self.free_block_ids.popleft() for _ in range(needed)]
        self.request_tables[request_id] = RequestBlockTable(request_id, taken, token_count)
        return self._snapshot(request_id)

    def append_slot(self, request_id: str) -> int:
        table = self.append_tokens(request_id, 1)
        position = table.token_count - 1
        return table.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        if request_id not in self.request_tables:
            raise KeyError(f"request has no allocated blocks: {request_id}")
        table = self.request_tables[request_id]
        new_count = table.token_count + token_count
        more = math.ceil(new_count / self.block_size) - math.ceil(
            table.token_count / self.block_size
        )
        self._ensure_free(more)
        table.block_ids.extend(self.free_block_ids.popleft() for _ in range(more))
        table.token_count = new_count
        return self._snapshot(request_id)

    def release(self, request_id: str) -> list[int]:
        table = self.request_tables.pop(request_id, None)
        if table is None:
            raise KeyError(f"request has no allocated blocks: {request_id}")
        released = list(table.block_ids)
        self.free_block_ids.extend(released)
        return released

    def _snapshot(self, request_id: str) -> RequestBlockTable:
        table = self.request_tables[request_id]
        return RequestBlockTable(request_id, list(table.block_ids), table.token_count)

    def _ensure_free(self, count: int) -> None:
        if count > len(self.free_block_ids):
            raise BlockAllocationError(
                f"not enough free KV blocks: needed={count} free={len(self.free_block_ids)}"
            )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: its prompt length and how many tokens it generates."""

    request_id: str
    prompt_tokens: int
    output_tokens: int


def make_trace(request_count: int, seed: int) -> list[TraceRequest]:
    """A fixed-seed list of requests with lognormal prompt and output lengths."""
    rng = random.Random(seed)

    def length(mu: float, sigma: float) -> int:
        return max(1, min(MAX_TOKENS, round(rng.lognormvariate(mu, sigma))))

    return [
        TraceRequest(f"req-{i}", length(PROMPT_MU, PROMPT_SIGMA), length(OUTPUT_MU, OUTPUT_SIGMA))
        for i in range(request_count)
    ]


@dataclass(slots=True)
class RunTimes:
    """Nanoseconds spent in each kind of allocator call during one replay, and their counts."""

    admit_ns: int = 0
    admits: int = 0
    decode_ns: int = 0
    appends: int = 0
    release_ns: int = 0
    releases: int = 0
    preemptions: int = 0
    steps: int = 0
    peak_used_blocks: int = 0

    @property
    def total_ns(self) -> int:
        return self.admit_ns + self.decode_ns + self.release_ns


def replay(
    trace: Sequence[TraceRequest], allocator: Allocator, max_running: int, decode: str
) -> RunTimes:
    """Run the trace to completion through ``allocator``; every request finishes.

    ``decode`` names the call a decode step makes per running request: ``append_slot``
    (pagedkv's hot path) or ``append_tokens`` (the article's, one token at a time).
    """
    clock = time.perf_counter_ns
    times = RunTimes()
    # waiting: (request, tokens it already holds: prompt plus what it generated before a
    # preemption). running: request ids in admission order, and what each still generates.
    waiting: deque[tuple[TraceRequest, int]] = deque((r, r.prompt_tokens) for r in trace)
    running: list[str] = []
    remaining: dict[str, int] = {}
    by_id = {r.request_id: r for r in trace}
    held: dict[str, int] = {}
    append: Callable[[str], object] = getattr(allocator, decode)
    while waiting or running:
        times.steps += 1
        # Admit first-come-first-served while the head of the queue fits.
        start = clock()
        while waiting and len(running) < max_running:
            request, token_count = waiting[0]
            if not allocator.can_allocate(token_count):
                break
            waiting.popleft()
            allocator.allocate(request.request_id, token_count)
            running.append(request.request_id)
            held[request.request_id] = token_count
            remaining.setdefault(request.request_id, request.output_tokens)
            times.admits += 1
        times.admit_ns += clock() - start
        # A prompt's blocks are all held from its admission to its first append (by count:
        # nothing is computed before), so the peak is taken here too (not timed).
        used = allocator.total_blocks - allocator.free_blocks
        times.peak_used_blocks = max(times.peak_used_blocks, used)
        if not running:
            raise RuntimeError(f"request {waiting[0][0].request_id} can never fit the pool")
        # One decode append per running request.
        start = clock()
        index = 0
        while index < len(running):
            request_id = running[index]
            try:
                append(request_id)
            except BlockAllocationError:
                # Preempt by recompute: the most recently admitted request gives its blocks back.
                victim = running.pop()
                allocator.release(victim)
                waiting.appendleft((by_id[victim], held[victim]))
                times.preemptions += 1
                continue  # retry this request, unless it was the victim itself
            held[request_id] += 1
            index += 1
        times.appends += len(running)
        times.decode_ns += clock() - start
        # The step's peak: after its appends, before its releases (not timed).
        used = allocator.total_blocks - allocator.free_blocks
        times.peak_used_blocks = max(times.peak_used_blocks, used)
        # Release the requests that produced their last token (only the calls are timed).
        finished: list[str] = []
        still_running: list[str] = []
        for request_id in running:
            remaining[request_id] -= 1
            (still_running if remaining[request_id] else finished).append(request_id)
        running = still_running
        start = clock()
        for request_id in finished:
            allocator.release(request_id)
        times.release_ns += clock() - start
        times.releases += len(finished)
    return times


def in_block_append_ns(method: str, repeats: int, appends: int) -> float:
    """Median ns of one in-block append: ``append_slot`` or ``append_tokens`` on a request
    allocated by count, ``append_token_slot`` on one allocated by token ids."""
    block_size = 16
    requests = appends // (block_size - 1)
    samples = []
    for _ in range(repeats):
        manager = KVBlockManager(requests + 1, block_size)
        request_ids = [f"r{i}" for i in range(requests)]
        for request_id in request_ids:
            # One token: 15 in-block appends left.
            if method == "append_token_slot":
                manager.allocate_prompt(request_id, [1])
            else:
                manager.allocate(request_id, 1)
        start = time.perf_counter_ns()
        if method == "append_token_slot":
            # A loop of its own: unpacking an argument tuple per call would cost ~80 ns.
            append_token_slot = manager.append_token_slot
            for request_id in request_ids:
                for _ in range(block_size - 1):
                    append_token_slot(request_id, 7)
        else:
            append: Callable[[str], object] = getattr(manager, method)
            for request_id in request_ids:
                for _ in range(block_size - 1):
                    append(request_id)
        samples.append((time.perf_counter_ns() - start) / (requests * (block_size - 1)))
    return statistics.median(samples)


def timed_runs(
    methods: dict[str, tuple[Callable[[], Allocator], str]],
    trace: Sequence[TraceRequest],
    max_running: int,
    runs: int,
) -> dict[str, list[RunTimes]]:
    """Replay the trace once per method to warm up, then ``runs`` times, the methods taking
    turns in every run (so a change of load hits them alike); progress on stderr."""
    for make, decode in methods.values():
        replay(trace, make(), max_running, decode)
    results: dict[str, list[RunTimes]] = {name: [] for name in methods}
    for run in range(runs):
        for name, (make, decode) in methods.items():
            print(f"  {name}: run {run + 1}/{runs}", file=sys.stderr, flush=True)
            results[name].append(replay(trace, make(), max_running, decode))
    return results


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
    parser.add_argument("--requests", type=int, default=10_000, help="requests in the trace")
    parser.add_argument("--spec-requests", type=int, default=200, help="requests for spec")
    parser.add_argument("--total-blocks", type=int, default=8192, help="blocks in the pool")
    parser.add_argument("--spec-total-blocks", type=int, default=1024, help="blocks for spec")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--max-running", type=int, default=256, help="most running requests")
    parser.add_argument("--runs", type=int, default=5, help="timed replays (median taken)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--skip-spec", action="store_true", help="time impl only")
    parser.add_argument(
        "--window-requests",
        type=int,
        default=2_000,
        help="requests of the ShareGPT-like trace in the sliding-window table (0 skips it)",
    )
    parser.add_argument(
        "--long-requests", type=int, default=48, help="requests of the long-context trace"
    )
    parser.add_argument(
        "--long-max-running", type=int, default=16, help="most running long-context requests"
    )
    parser.add_argument(
        "--window-total-blocks",
        type=int,
        default=262_144,
        help="blocks in the sliding-window table's pools",
    )
    parser.add_argument(
        "--prefix-requests",
        type=int,
        default=2_000,
        help="requests in each prefix-caching trace (0 skips them)",
    )
    args = parser.parse_args(argv)
    if min(args.requests, args.total_blocks, args.block_size, args.max_running, args.runs) < 1:
        return fail(PROG, "--requests, --total-blocks, --block-size, --max-running, --runs: >= 1")
    trace = make_trace(args.requests, args.seed)
    prompts = sorted(r.prompt_tokens for r in trace)
    outputs = sorted(r.output_tokens for r in trace)
    longest = max(r.prompt_tokens + r.output_tokens for r in trace)
    if math.ceil(longest / args.block_size) > args.total_blocks:
        return fail(PROG, f"a request of {longest} tokens cannot fit {args.total_blocks} blocks")
    print(
        f"trace: {len(trace):,} requests, seed {args.seed}; prompt tokens mean "
        f"{statistics.mean(prompts):.0f} p99 {prompts[int(0.99 * len(prompts))]}; output "
        f"tokens mean {statistics.mean(outputs):.0f} p99 {outputs[int(0.99 * len(outputs))]}"
    )
    blocks = f"{args.total_blocks:,} blocks"

    def impl() -> Allocator:
        return KVBlockManager(args.total_blocks, args.block_size)

    def article() -> Allocator:
        return ArticleStyleManager(args.total_blocks, args.block_size)

    methods = {
        f"impl append_slot, {blocks}": (impl, "append_slot"),
        f"impl append_tokens, {blocks}": (impl, "append_tokens"),
        f"article-style append_tokens, {blocks}": (article, "append_tokens"),
    }
    results = timed_runs(methods, trace, args.max_running, args.runs)
    rows = [summarize(name, runs, trace) for name, runs in results.items()]
    if not args.skip_spec:
        spec_trace = make_trace(args.spec_requests, args.seed)
        name = f"spec append_slot, {args.spec_total_blocks:,} blocks"

        def spec_backed() -> Allocator:
            return SpecBackedManager(args.spec_total_blocks, args.block_size)

        spec_runs = timed_runs(
            {name: (spec_backed, "append_slot")},
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
    for method in ("append_slot", "append_token_slot", "append_tokens"):
        median_ns = in_block_append_ns(method, repeats=7, appends=200_000)
        print(f"median in-block decode append, impl {method}, tight loop: {median_ns:.0f} ns")
    if args.prefix_requests > 0:
        print_prefix_tables(args.prefix_requests, args.seed)
    if args.window_requests > 0:
        print_window_table(args, args.window_requests, args.long_requests)
    return 0


# The window table's KV cache groups: each windowed configuration and full attention with
# as many groups, which it is compared with.
WINDOW = 4096
WINDOW_GROUPS: tuple[tuple[str, tuple[int | None, ...]], ...] = (
    ("full", (None,)),
    ("Mistral-like", (WINDOW,)),
    ("full x2", (None, None)),
    ("Gemma-like", (None, WINDOW)),
)


def long_context_trace(request_count: int, seed: int) -> list[TraceRequest]:
    """A fixed-seed long-context trace: prompts log-uniform in [8k, 32k] tokens, outputs
    log-uniform in [1k, 8k]."""
    rng = random.Random(seed)

    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high))))

    return [
        TraceRequest(f"long-{i}", log_uniform(8192, 32768), log_uniform(1024, 8192))
        for i in range(request_count)
    ]


def print_window_table(args: argparse.Namespace, requests: int, long_requests: int) -> None:
    """KV blocks held at the peak and allocator cost per token, with and without a window."""
    traces = (
        ("ShareGPT-like", make_trace(requests, args.seed), args.max_running),
        ("long-context", long_context_trace(long_requests, args.seed), args.long_max_running),
    )
    print(
        f"sliding window {WINDOW:,} tokens; pool {args.window_total_blocks:,} blocks of "
        f"{args.block_size} (no preemption: the peak is the demand)"
    )
    print(
        "| trace | groups | group_windows | peak blocks held | vs full attention "
        "| preemptions | ns/decode append | us allocator per generated token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for trace_name, trace, max_running in traces:
        print(f"  window table: {trace_name}", file=sys.stderr, flush=True)
        methods = {
            name: (
                _window_manager(args.window_total_blocks, args.block_size, windows),
                "append_slot",
            )
            for name, windows in WINDOW_GROUPS
        }
        results = timed_runs(methods, trace, max_running, args.runs)
        full_peak = {1: 0, 2: 0}
        for name, windows in WINDOW_GROUPS:
            runs = results[name]
            peak = runs[0].peak_used_blocks
            if all(window is None for window in windows):
                full_peak[len(windows)] = peak
            generated = sum(r.output_tokens for r in trace)
            decode = statistics.median(r.decode_ns / max(1, r.appends) for r in runs)
            per_token = statistics.median(r.total_ns / generated / 1000 for r in runs)
            print(
                f"| {trace_name} | {name} | {windows} | {peak:,} "
                f"| {peak / full_peak[len(windows)]:.2f} | {runs[0].preemptions:,} "
                f"| {decode:,.0f} | {per_token:.3f} |"
            )
            sys.stdout.flush()


def _window_manager(
    total_blocks: int, block_size: int, group_windows: tuple[int | None, ...]
) -> Callable[[], Allocator]:
    def make() -> Allocator:
        return KVBlockManager(total_blocks, block_size, group_windows=group_windows)

    return make


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
