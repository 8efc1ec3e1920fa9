"""``python -m harness.bench.host_prefix``: the prefix hits a host tier adds on a
prefix-heavy trace, allocator work only (no model, no torch).

The trace takes its lengths from the ShareGPT-like generator (``harness.bench.traces``):
each request's prompt is one of ``--systems`` shared system prompts (Zipf(1.1)
popularity) followed by a unique suffix of the generated prompt length, and it generates
the generated output length. It is replayed by ``harness.bench.prefix.replay_prompts``
(FCFS admission with ``allocate`` by token ids, one ``append`` per running request
per step, preemption by recompute) on a device pool too small to keep every system
prompt cached, once without a host tier and once per ``--host-blocks`` size with
``host_prefix_cache``: a freed cached block is copied to the host, so a prefix evicted
from the device comes back from the host on a later hit. Hits are deterministic (fixed
seed); the admission times are medians over ``--runs`` replays after one warm-up, the
configurations taking turns in every run.
"""

import random
import statistics
import sys
from collections.abc import Sequence

from harness.bench.prefix import VOCABULARY, AdmissionStats, PromptRequest, replay_prompts
from harness.bench.traces import make_trace
from harness.parsing import OneLineParser, fail, int_in, run_interruptible
from impl import KVCacheManager
from spec import MAX_TOTAL_BLOCKS, blocks_for_tokens

PROG = "python -m harness.bench.host_prefix"
BLOCK_SIZE = 16


def shared_prefix_trace(
    request_count: int, systems: int, system_tokens: int, seed: int
) -> list[PromptRequest]:
    """``make_trace``'s lengths behind ``systems`` shared system prompts of
    ``system_tokens`` tokens, picked with Zipf(1.1) popularity."""
    rng = random.Random(seed)
    prompts = [
        tuple(rng.randrange(VOCABULARY) for _ in range(system_tokens)) for _ in range(systems)
    ]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(systems)]
    return [
        PromptRequest(
            shape.request_id,
            rng.choices(prompts, weights)[0]
            + tuple(rng.randrange(VOCABULARY) for _ in range(shape.prompt_tokens)),
            shape.output_tokens,
        )
        for shape in make_trace(request_count, seed)
    ]


def replay_with_host(
    trace: Sequence[PromptRequest], total_blocks: int, host_blocks: int, max_running: int
) -> tuple[AdmissionStats, int]:
    """One replay on a fresh manager with a host tier of ``host_blocks`` (0: none); its
    stats and the prefix-hit blocks found on the host only."""
    manager = KVCacheManager(
        total_blocks, BLOCK_SIZE, host_blocks=host_blocks, host_prefix_cache=host_blocks > 0
    )
    stats = replay_prompts(trace, manager, max_running, seed=0)
    return stats, manager.usage().host_hit_blocks


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=PROG,
        description="Prefix-hit tokens with and without a host tier on a prefix-heavy "
        "ShareGPT-like trace, allocator work only; admission times are medians over --runs "
        "replays after a warm-up, the configurations taking turns.",
    )
    parser.add_argument("--requests", type=int_in(1), default=2_000, help="requests in the trace")
    parser.add_argument("--systems", type=int_in(1), default=32, help="shared system prompts")
    parser.add_argument(
        "--system-tokens", type=int_in(1), default=512, help="tokens per system prompt"
    )
    parser.add_argument(
        "--total-blocks", type=int_in(1, MAX_TOTAL_BLOCKS), default=2_048, help="device blocks"
    )
    parser.add_argument(
        "--host-blocks",
        type=int_in(1, MAX_TOTAL_BLOCKS),
        nargs="+",
        default=[2_048, 8_192],
        help="host tier sizes to compare with none (default 2048 8192)",
    )
    parser.add_argument("--max-running", type=int_in(1), default=64, help="most running requests")
    parser.add_argument("--runs", type=int_in(1), default=3, help="timed replays (median taken)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    args = parser.parse_args(argv)
    trace = shared_prefix_trace(args.requests, args.systems, args.system_tokens, args.seed)
    longest = max(len(r.token_ids) + r.output_tokens for r in trace)
    if blocks_for_tokens(BLOCK_SIZE, longest) > args.total_blocks:
        return fail(PROG, f"a request of {longest} tokens cannot fit {args.total_blocks} blocks")
    sizes = [0, *args.host_blocks]
    for host_blocks in sizes:  # warm-up
        replay_with_host(trace, args.total_blocks, host_blocks, args.max_running)
    runs: dict[int, list[tuple[AdmissionStats, int]]] = {size: [] for size in sizes}
    for run in range(args.runs):
        for host_blocks in sizes:
            print(f"  host {host_blocks}: run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            runs[host_blocks].append(
                replay_with_host(trace, args.total_blocks, host_blocks, args.max_running)
            )
    prompt_tokens = runs[0][0][0].prompt_tokens
    base_hits = runs[0][0][0].hit_tokens
    print(
        f"trace: {len(trace):,} requests, seed {args.seed}, {args.systems} system prompts of "
        f"{args.system_tokens} tokens; device pool {args.total_blocks:,} blocks x {BLOCK_SIZE}"
    )
    print(
        "| host blocks | preemptions | prompt tokens hit | hit on the host only (tokens) "
        "| extra hit tokens vs no host | blocks copied to host / back | admit us p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for host_blocks in sizes:
        stats, host_hits = runs[host_blocks][0]
        admit_us = statistics.median(
            statistics.median(s.admit_ns) / 1000 for s, _ in runs[host_blocks]
        )
        print(
            f"| {host_blocks:,} | {stats.preemptions:,} "
            f"| {stats.hit_tokens:,} ({stats.hit_tokens / max(1, prompt_tokens):.1%}) "
            f"| {host_hits * BLOCK_SIZE:,} | {stats.hit_tokens - base_hits:+,} "
            f"| {stats.blocks_to_host:,} / {stats.blocks_to_device:,} | {admit_us:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
