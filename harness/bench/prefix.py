"""Prefix-caching traces for ``harness.bench.allocator``: admission cost with shared prefixes.

Two fixed-seed traces, allocator work only (no model):
- *prefix-heavy*: 8 system prompts of 1,024 tokens picked with Zipf popularity, each
  followed by a unique suffix; continuous batching as in the ShareGPT-like trace, with
  ``allocate`` by token ids for admission and ``append`` of each token for decoding;
- *revival*: 64 distinct 1,024-token prompts, each request one of them plus a short
  unique question, 4 seats, so that almost every admission revives a 64-block prefix from
  the cached free queue. Run at several pool sizes to show admission cost does not grow
  with the number of free blocks.
Every block hash is counted, to show each block is hashed once in a request's life.
"""

import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.runtime.preemption import append_or_preempt, preempt_request
from impl import BlockAllocationError, KVCacheManager, Transfers, default_block_hash

SYSTEM_PROMPT_TOKENS = 1024
VOCABULARY = 49_152  # SmolLM2's vocabulary size: token ids look like real ones


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """One request: its prompt's token ids and how many tokens it generates."""

    request_id: str
    token_ids: tuple[int, ...]
    output_tokens: int


@dataclass(slots=True)
class AdmissionStats:
    """Per-admission wall times (ns) and the counters a prefix trace reports."""

    admit_ns: list[int] = field(default_factory=list)
    decode_ns: int = 0
    appends: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    hashes: int = 0
    preemptions: int = 0
    blocks_to_host: int = 0  # swap copies (the host prefix cache's), counted not made
    blocks_to_device: int = 0


class CountingHash:
    """The default block hash, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, parent_hash: int, token_ids: tuple[int, ...]) -> int:
        self.calls += 1
        return default_block_hash(parent_hash, token_ids)


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCABULARY) for _ in range(count))


def prefix_heavy_trace(request_count: int, seed: int) -> list[PromptRequest]:
    """8 system prompts with Zipf(1.1) popularity, unique lognormal suffixes and outputs."""
    rng = random.Random(seed)
    systems = [_tokens(rng, SYSTEM_PROMPT_TOKENS) for _ in range(8)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(systems))]
    requests = []
    for index in range(request_count):
        system = rng.choices(systems, weights)[0]
        suffix = _tokens(rng, max(1, min(1024, round(rng.lognormvariate(4.2, 0.8)))))
        output = max(1, min(1024, round(rng.lognormvariate(4.6, 0.8))))
        requests.append(PromptRequest(f"req-{index}", system + suffix, output))
    return requests


def revival_trace(request_count: int, seed: int) -> list[PromptRequest]:
    """64 distinct 1,024-token prompts in random order, each with a 1-15 token question."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, SYSTEM_PROMPT_TOKENS) for _ in range(64)]
    return [
        PromptRequest(f"req-{i}", rng.choice(prompts) + _tokens(rng, rng.randint(1, 15)), 16)
        for i in range(request_count)
    ]


def replay_prompts(
    trace: Sequence[PromptRequest], manager: KVCacheManager, max_running: int, seed: int
) -> AdmissionStats:
    """Continuous batching with prefix caching; preempted requests recompute with their tokens.

    The manager's transfers (a host tier's copies among them) are taken, untimed, after
    every admission, preemption and release, and counted: no K/V exists to move.
    """
    clock = time.perf_counter_ns
    rng = random.Random(seed)
    stats = AdmissionStats()
    waiting: deque[tuple[PromptRequest, tuple[int, ...]]] = deque(
        (request, request.token_ids) for request in trace
    )
    running: list[str] = []
    remaining: dict[str, int] = {}
    tokens_of: dict[str, list[int]] = {}
    by_id = {request.request_id: request for request in trace}
    token_of: dict[str, int] = {}  # each running request's token this step

    def append(request_id: str) -> object:
        return manager.append(request_id, (token_of[request_id],))

    def count(transfers: Transfers) -> None:
        stats.blocks_to_host += len(transfers.device_to_host)
        stats.blocks_to_device += len(transfers.host_to_device)

    def preempt(victim: str) -> None:
        count(preempt_request(manager, victim, "recompute").transfers)
        waiting.appendleft((by_id[victim], tuple(tokens_of[victim])))
        stats.preemptions += 1

    while waiting or running:
        while waiting and len(running) < max_running:
            request, token_ids = waiting[0]
            start = clock()
            try:
                allocation = manager.allocate(request.request_id, token_ids)
            except BlockAllocationError:
                break
            stats.admit_ns.append(clock() - start)
            count(manager.take_transfers())
            waiting.popleft()
            stats.hit_tokens += allocation.cached_tokens
            stats.prompt_tokens += len(token_ids)
            running.append(request.request_id)
            tokens_of[request.request_id] = list(token_ids)
            remaining.setdefault(request.request_id, request.output_tokens)
        if not running:
            raise RuntimeError(f"request {waiting[0][0].request_id} can never fit the pool")
        new_tokens = [rng.randrange(VOCABULARY) for _ in running]
        token_of.update(zip(running, new_tokens, strict=True))
        start = clock()
        append_or_preempt(running, append, preempt)
        stats.decode_ns += clock() - start
        stats.appends += len(running)
        still_running = []
        for request_id, token_id in zip(running, new_tokens, strict=False):
            tokens_of[request_id].append(token_id)
            remaining[request_id] -= 1
            if remaining[request_id]:
                still_running.append(request_id)
            else:
                manager.release(request_id)
                count(manager.take_transfers())
        running = still_running
    return stats


def run_prefix_trace(
    name: str, trace: Sequence[PromptRequest], total_blocks: int, max_running: int, seed: int
) -> str:
    """Replay once with a counting hash (warm-up and hash count), then time the default one."""
    # NOTE: the trace holds millions of ints in tuples; without a freeze, the cyclic GC
    # walks them all now and then, inside a timed call (4 ms spikes at p99). Serving
    # engines freeze their start-up objects the same way.
    gc.collect()
    gc.freeze()
    counting = CountingHash()
    replay_prompts(trace, KVCacheManager(total_blocks, 16, block_hash=counting), max_running, seed)
    stats = replay_prompts(trace, KVCacheManager(total_blocks, 16), max_running, seed)
    admit_us = sorted(ns / 1000 for ns in stats.admit_ns)
    final_tokens = sum(len(r.token_ids) + r.output_tokens for r in trace)
    full_blocks = final_tokens // 16
    return (
        f"| {name} | {total_blocks:,} | {len(trace):,} | {stats.preemptions:,} "
        f"| {stats.hit_tokens / max(1, stats.prompt_tokens):.1%} "
        f"| {statistics.median(admit_us):.1f} | {admit_us[int(0.99 * len(admit_us))]:.1f} "
        f"| {stats.decode_ns / max(1, stats.appends):.0f} "
        f"| {counting.calls / max(1, full_blocks):.2f} |"
    )


PREFIX_TABLE_HEADER = (
    "| trace | blocks | requests | preemptions | prompt tokens hit | admit us p50 "
    "| admit us p99 | ns/decode append | block hashes per full block |\n"
    "|---|---|---|---|---|---|---|---|---|"
)
