"""``python -m harness.bench.api_cost --before DIR``: the allocator's hot calls, this checkout
against another one (``git worktree add --detach DIR REV``), in one run.

Each round runs this file as a probe once per checkout, the two taking turns (before, after,
then after, before, ...), each in its own process with its own ``impl`` and ``spec``; the
table gives the median of the rounds and every round. A probe times, with the GC frozen
after its inputs are built (as serving engines do after start-up):
- the ShareGPT-like trace of ``--requests`` requests (10,000; ``harness.bench.traces``,
  seed 0; 8,192 blocks of 16, up to 256 running, FCFS admission by count, one decode
  call per running request per step, the most recently admitted preempted by recompute
  when a call finds no block, release on finish), once per decode call: the engine's
  (before the one table, at 23427bb, ``append_slots(request_id, 1)``; with it
  ``append(request_id, 1)``), the article layer's ``append_slot`` and ``append_tokens``,
  and the article-style manager of ``harness.bench.article_manager``; microseconds of
  allocator calls per generated token, and nanoseconds per decode call;
- the same decode calls on the first fifth of that trace in a pool of two full-attention
  KV cache groups (65,536 blocks: nothing preempted);
- in-block decode calls in a tight loop (each request allocated one token, then 15 calls
  into its first block of 16): the engine's by count and by one token id (before:
  ``append_token_id_slots``), the article layer's ``append_slot`` and ``append_tokens``.
Each call first replays the trace's first twentieth untimed (the warm-up). The probe's
own loop is the same code in both processes, so only the allocator differs.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROG = "python -m harness.bench.api_cost"
BLOCK_SIZE = 16
# Any below: a manager or a trace of the checkout under test, whose classes differ from one
# checkout to the other; the probe imports them from PYTHONPATH at run time.


def engine_manager(total_blocks: int, group_windows: tuple[int | None, ...] = (None,)) -> Any:
    """The manager the engine drives in the checkout under test, and its decode call by
    count and by token ids (``Any``: either checkout's class)."""
    import impl  # noqa: PLC0415  (the checkout under test, on PYTHONPATH)

    if hasattr(impl, "KVCacheManager"):
        return impl.KVCacheManager(total_blocks, BLOCK_SIZE, group_windows=group_windows)
    return impl.KVBlockManager(total_blocks, BLOCK_SIZE, group_windows=group_windows)


def engine_calls(manager: Any) -> tuple[Callable[..., object], Callable[..., object]]:
    """``manager``'s decode call by count and by token ids, as the engine makes them."""
    if hasattr(manager, "append"):
        return manager.append, manager.append
    return manager.append_slots, manager.append_token_id_slots


def replay(
    trace: Sequence[Any], manager: Any, decode: Callable[..., object], *args: object
) -> dict[str, float]:
    """The trace through ``manager``, ``decode(request_id, *args)`` per running request per
    step; the allocator's nanoseconds by phase and the call counts."""
    from impl import BlockAllocationError  # noqa: PLC0415

    clock = time.thread_time_ns
    waiting: deque[tuple[Any, int]] = deque((r, r.prompt_tokens) for r in trace)
    by_id = {r.request_id: r for r in trace}
    running: list[str] = []
    remaining: dict[str, int] = {}
    held: dict[str, int] = {}
    admit_ns = decode_ns = release_ns = appends = 0
    while waiting or running:
        start = clock()
        while waiting and len(running) < 256:
            request, tokens = waiting[0]
            try:
                manager.allocate(request.request_id, tokens)
            except BlockAllocationError:
                break
            waiting.popleft()
            running.append(request.request_id)
            held[request.request_id] = tokens
            remaining.setdefault(request.request_id, request.output_tokens)
        admit_ns += clock() - start
        start = clock()
        index = 0
        while index < len(running):
            try:
                decode(running[index], *args)
            except BlockAllocationError:
                victim = running.pop()
                manager.release(victim)
                waiting.appendleft((by_id[victim], held[victim]))
                continue
            index += 1
        decode_ns += clock() - start
        appends += len(running)
        finished = []
        for request_id in running:
            held[request_id] += 1
            remaining[request_id] -= 1
            if not remaining[request_id]:
                finished.append(request_id)
        running = [r for r in running if remaining[r]]
        start = clock()
        for request_id in finished:
            manager.release(request_id)
        release_ns += clock() - start
    generated = sum(r.output_tokens for r in trace)
    total = admit_ns + decode_ns + release_ns
    return {"us_per_token": total / generated / 1000, "ns_per_decode": decode_ns / appends}


def in_block_ns(
    manager: Any, allocate_ids: bool, decode: Callable[..., object], *args: object
) -> float:
    """ns per in-block decode call: a request of one token per block of the pool but one
    (2,000), 15 calls each."""
    requests = [f"r{i}" for i in range(manager.total_blocks - 1)]
    for request_id in requests:
        if allocate_ids:
            (manager.allocate if hasattr(manager, "append") else manager.allocate_prompt)(
                request_id, [1]
            )
        else:
            manager.allocate(request_id, 1)
    start = time.thread_time_ns()
    for request_id in requests:
        for _ in range(BLOCK_SIZE - 1):
            decode(request_id, *args)
    return (time.thread_time_ns() - start) / (len(requests) * (BLOCK_SIZE - 1))


def probe(requests: int) -> dict[str, float]:
    """Every figure once, in this process's checkout."""
    from harness.bench.article_manager import ArticleStyleManager  # noqa: PLC0415
    from harness.bench.traces import make_trace  # noqa: PLC0415
    from impl import KVBlockManager  # noqa: PLC0415

    trace = make_trace(requests, 0)
    two_group_trace = trace[: max(1, requests // 5)]
    in_block = min(2000, requests) + 1  # blocks: one per request, and one spare
    gc.collect()
    gc.freeze()
    figures: dict[str, float] = {}
    engine = engine_manager(8192)
    article = KVBlockManager(8192, BLOCK_SIZE)
    article_tokens = KVBlockManager(8192, BLOCK_SIZE)
    baseline = ArticleStyleManager(8192, BLOCK_SIZE)
    runs: list[tuple[str, Any, Callable[..., object], tuple[object, ...]]] = [
        ("engine decode call", engine, engine_calls(engine)[0], (1,)),
        ("article append_slot", article, article.append_slot, ()),
        ("article append_tokens", article_tokens, article_tokens.append_tokens, ()),
        ("article-style manager append_tokens", baseline, baseline.append_tokens, ()),
    ]
    # Warm-up: each call through a short trace on a pool of its own kind, untimed.
    warm_ups = [
        (engine_manager(8192), "engine"),
        (KVBlockManager(8192, BLOCK_SIZE), "append_slot"),
        (KVBlockManager(8192, BLOCK_SIZE), "append_tokens"),
        (ArticleStyleManager(8192, BLOCK_SIZE), "append_tokens"),
    ]
    for manager, call in warm_ups:
        if call == "engine":
            replay(trace[: requests // 20], manager, engine_calls(manager)[0], 1)
        else:
            replay(trace[: requests // 20], manager, getattr(manager, call))
    for name, manager, decode, args in runs:
        result = replay(trace, manager, decode, *args)
        figures[f"trace, {name}: us per generated token"] = result["us_per_token"]
        figures[f"trace, {name}: ns per decode call"] = result["ns_per_decode"]
    two = engine_manager(65_536, (None, None))
    two_by_count, _ = engine_calls(two)
    two_article = KVBlockManager(65_536, BLOCK_SIZE, group_windows=(None, None))
    figures["two full groups, engine decode call: ns per decode call"] = replay(
        two_group_trace, two, two_by_count, 1
    )["ns_per_decode"]
    figures["two full groups, article append_slot: ns per decode call"] = replay(
        two_group_trace, two_article, two_article.append_slot
    )["ns_per_decode"]
    tight = engine_manager(in_block)
    figures["in-block engine decode call by count: ns"] = in_block_ns(
        tight, False, engine_calls(tight)[0], 1
    )
    tight_ids = engine_manager(in_block)
    figures["in-block engine decode call by one token id: ns"] = in_block_ns(
        tight_ids, True, engine_calls(tight_ids)[1], (7,)
    )
    slot = KVBlockManager(in_block, BLOCK_SIZE)
    figures["in-block article append_slot: ns"] = in_block_ns(slot, False, slot.append_slot)
    tokens = KVBlockManager(in_block, BLOCK_SIZE)
    figures["in-block article append_tokens: ns"] = in_block_ns(tokens, False, tokens.append_tokens)
    return figures


def run_probe(checkout: Path, requests: int) -> dict[str, float]:
    """This file as a probe in ``checkout`` (its own ``impl``, ``spec`` and ``harness``)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # NOTE: -c, not the file's path: a script's folder would come first on sys.path.
    code = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-c", code, "--probe", "--requests", str(requests)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="the other checkout (e.g. a worktree)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both probes")
    parser.add_argument(
        "--requests", type=int, default=10_000, help="requests of the trace (default 10,000)"
    )
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.requests)))
        return 0
    if args.rounds < 1 or args.requests < 20:
        print(f"{PROG}: --rounds must be >= 1 and --requests >= 20", file=sys.stderr)
        return 2
    if args.before is None or not (args.before / "impl").is_dir():
        print(f"{PROG}: --before must name a checkout of pagedkv", file=sys.stderr)
        return 2
    after = Path(__file__).resolve().parents[2]
    rounds: dict[str, list[list[float]]] = {"before": [], "after": []}
    for number in range(args.rounds):
        order = ("before", "after") if number % 2 == 0 else ("after", "before")
        for side in order:
            print(f"  round {number + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            figures = run_probe(args.before if side == "before" else after, args.requests)
            rounds[side].append(list(figures.values()))
            names = list(figures)
    print("| figure | before | after | after / before |")
    print("|---|---|---|---|")
    for index, name in enumerate(names):
        before = [values[index] for values in rounds["before"]]
        after_values = [values[index] for values in rounds["after"]]
        b, a = statistics.median(before), statistics.median(after_values)
        print(f"| {name} | {_cell(b, before)} | {_cell(a, after_values)} | {a / b:.2f} |")
    return 0


def _cell(median: float, values: list[float]) -> str:
    digits = 3 if median < 10 else 0
    every = ", ".join(f"{v:,.{digits}f}" for v in values)
    return f"{median:,.{digits}f} ({every})"


if __name__ == "__main__":
    sys.exit(main())
