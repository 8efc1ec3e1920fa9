"""The allocator benchmark's sliding-window table: KV blocks held at the peak and allocator
cost per token on pools with KV cache groups, against full attention with as many groups.

A 4,096-token window alone (Mistral-like) and beside a full-attention group (Gemma-like),
on the ShareGPT-like trace and a long-context one (prompts of 8k-32k tokens, 1k-8k
generated).
"""

import argparse
import statistics
import sys
from collections.abc import Callable

from harness.bench.article_manager import Allocator
from harness.bench.replay import timed_runs
from harness.bench.traces import long_context_trace, make_trace
from impl import KVBlockManager

# The window table's KV cache groups: each windowed configuration and full attention with
# as many groups, which it is compared with.
WINDOW = 4096
WINDOW_GROUPS: tuple[tuple[str, tuple[int | None, ...]], ...] = (
    ("full", (None,)),
    ("Mistral-like", (WINDOW,)),
    ("full x2", (None, None)),
    ("Gemma-like", (None, WINDOW)),
)


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
