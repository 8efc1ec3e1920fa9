"""The ``pagedkv`` console script: ``check`` (the main command), ``bench NAME``, ``fuzz``
and ``conformance``.

A dispatcher only: ``pagedkv check ...`` is ``python -m harness ...`` with the same options
and exit codes, ``pagedkv bench NAME ...`` is ``python -m harness.bench.NAME ...``,
``pagedkv fuzz`` runs ``harness.cli.fuzz`` (a source checkout's long fuzzing), and
``pagedkv conformance ...`` is ``python -m harness.conformance ...``.
Importing it loads no torch; each command imports what it runs, when it runs: a benchmark
by its module's name in ``BENCHMARKS`` (the import graph's tests count each as an arrow
from the CLI to ``harness.bench``).
"""

import importlib
import sys
from collections.abc import Callable, Sequence

from harness.parsing import (
    EXIT_BAD_INPUT,
    exit_on_interrupt,
    fail,
    interrupts_raise,
    run_interruptible,
)
from harness.progress import stderr_as_progress

PROG = "pagedkv"

# name -> (module, what it measures); each module has main(argv) -> exit status.
BENCHMARKS = {
    "allocator": ("harness.bench.allocator", "allocator throughput on a serving trace (no torch)"),
    "attention": ("harness.bench.attention", "ms per decode attention call, gather vs kernels"),
    "decode": ("harness.bench.decode", "decode tok/s and KV bytes, dense vs paged vs HF CB"),
    "events": ("harness.bench.events", "KV event batches/s, our ZMQ publisher vs vLLM's"),
    "fragmentation": ("harness.bench.fragmentation", "the article's fragmentation figures"),
    "fuzz_cluster": ("harness.bench.fuzz_cluster", "fuzz steps/s/core, Ray + Redis vs fuzz.sh"),
    "host_prefix": ("harness.bench.host_prefix", "prefix hits a host tier adds (no torch)"),
    "plots": ("harness.bench.plots", "the figures of docs/results.md, as PNGs"),
    "preemption": ("harness.bench.preemption", "the cost of a preemption, swap vs recompute"),
    "speculation": ("harness.bench.speculation", "decode tok/s with speculative decoding"),
}

USAGE = f"""usage: {PROG} COMMAND [OPTIONS]

A verified paged KV-cache block allocator, checked under a real transformer.

commands:
  check            generate with a model twice (HF's dense cache, the paged pool) and
                   check per request; = python -m harness (pagedkv check --help)
  bench NAME       run a benchmark (pagedkv bench --help lists them)
  fuzz             long fuzzing of the allocator against its spec, from a source
                   checkout (pagedkv fuzz --help)
  conformance      check a shipped allocator (vllm, transformers, your own adapter)
                   against the spec; = python -m harness.conformance

Exit status: 0 success, 1 a check failed, 2 bad input, 130 interrupted.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pagedkv COMMAND ...``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_BAD_INPUT
    command, rest = args[0], args[1:]
    # Ctrl-C while the command imports torch and transformers: one line and exit 130; each
    # command's own handling takes over once it runs (and here, whatever happens).
    exit_on_interrupt(f"{PROG} {' '.join(args[:2]) if command == 'bench' else command}")
    try:
        return _dispatch(command, rest)
    finally:
        interrupts_raise()


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "check":
        from harness.cli.main import main as check  # noqa: PLC0415

        return check(rest, prog=f"{PROG} check")
    if command == "bench":
        return _bench(rest)
    if command == "fuzz":
        from harness.cli.fuzz import main as fuzz  # noqa: PLC0415

        interrupts_raise()
        return fuzz(rest, prog=f"{PROG} fuzz")
    if command == "conformance":
        from harness.conformance.cli import main as conformance  # noqa: PLC0415

        return conformance(rest, prog=f"{PROG} conformance")
    known = "check, bench, fuzz or conformance"
    return fail(PROG, f"unknown command {command!r} (expected {known})")


def _bench(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        listing = "\n".join(f"  {name:<14} {about}" for name, (_, about) in BENCHMARKS.items())
        text = f"usage: {PROG} bench NAME [OPTIONS]   ({PROG} bench NAME --help)\n\n{listing}\n"
        print(text, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_BAD_INPUT
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        known = ", ".join(BENCHMARKS)
        return fail(f"{PROG} bench", f"unknown benchmark {name!r} (one of: {known})")
    module = importlib.import_module(BENCHMARKS[name][0])
    benchmark: Callable[[list[str]], int] = module.main
    return run_interruptible(f"{PROG} bench {name}", lambda: _with_bars(benchmark, rest))


def _with_bars(benchmark: Callable[[list[str]], int], args: list[str]) -> int:
    # The benchmarks print their stages ("... round 2/5") on stderr: bars on a terminal.
    with stderr_as_progress():
        return benchmark(args)
