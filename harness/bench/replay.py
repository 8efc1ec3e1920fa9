"""Replaying a trace through an allocator: a continuous-batching scheduler that only does
allocator work (no model), timing the calls of each phase.

Admit first-come-first-served while blocks allow (an allocation refused for want of blocks
ends the step's admissions), one decode append per running request per step, release on
finish, and preempt the most recently admitted request by recompute when a decode append
finds no free block (``harness.runtime.preemption``).
"""

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harness.bench.article_manager import Allocator
from harness.bench.traces import TraceRequest
from harness.runtime.preemption import append_or_preempt
from impl import BlockAllocationError


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

    ``decode`` names the call a decode step makes per running request, one token each:
    ``append`` (the table's, ``KVCacheManager``), ``append_slot`` (the article layer's hot
    path) or ``append_tokens`` (the article's).
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

    def preempt(victim: str) -> None:
        """Preempt by recompute: the victim gives its blocks back and waits at the head."""
        allocator.release(victim)
        waiting.appendleft((by_id[victim], held[victim]))
        times.preemptions += 1

    while waiting or running:
        times.steps += 1
        # Admit first-come-first-served while the head of the queue fits.
        start = clock()
        while waiting and len(running) < max_running:
            request, token_count = waiting[0]
            try:
                allocator.allocate(request.request_id, token_count)
            except BlockAllocationError:
                break
            waiting.popleft()
            running.append(request.request_id)
            held[request.request_id] = token_count
            remaining.setdefault(request.request_id, request.output_tokens)
            times.admits += 1
        times.admit_ns += clock() - start
        # A prompt's blocks are all held from its admission to its first append (by count:
        # nothing is computed before), so the peak is taken here too (not timed).
        times.peak_used_blocks = max(times.peak_used_blocks, allocator.usage().used_blocks)
        if not running:
            raise RuntimeError(f"request {waiting[0][0].request_id} can never fit the pool")
        # One decode append per running request.
        start = clock()
        append_or_preempt(running, append, preempt)
        times.decode_ns += clock() - start
        times.appends += len(running)
        for request_id in running:  # a victim never appended this step: its count is right
            held[request_id] += 1
        # The step's peak: after its appends, before its releases (not timed).
        times.peak_used_blocks = max(times.peak_used_blocks, allocator.usage().used_blocks)
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
