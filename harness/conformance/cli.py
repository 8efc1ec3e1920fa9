"""``python -m harness.conformance`` (``pagedkv conformance``): run the conformance kit
against a bundled target or your own adapter.

Exit 0 when every property held, 1 on a discrepancy in the target (the shrunk steps, the
target's and the spec's side, bug or declared difference), 2 on a fault in the command or
the adapter (one line: an unknown target, a module that does not import, a factory or an
adapter that breaks the contract, ``harness.conformance.validate``), 130 on Ctrl-C.
"""

import sys
import time
from collections.abc import Sequence

from harness.conformance.report import Report
from harness.conformance.run import RunInterrupted, check_target
from harness.conformance.targets import (
    TARGETS,
    Factory,
    TargetUnavailableError,
    configuration,
    load_factory,
)
from harness.conformance.validate import AdapterError
from harness.parsing import EXIT_INTERRUPTED, OneLineParser, fail

PROG = "python -m harness.conformance"

DESCRIPTION = """\
Check a KV-cache block allocator against pagedkv's executable spec with stateful random
testing (Hypothesis). Operation targets (pagedkv, article, your adapter) get one of the
spec's operations a step (admit a prompt with prefix lookup, allocate or append, fork,
release, preempt, truncate: those the target supports); engine targets (vllm,
transformers) run their server's own scheduler a step at a time (requests arrive, the
scheduler admits, decodes, preempts; a stub model samples the tokens and finishes
requests), and every allocator call the step makes is checked. Each call is judged by the
spec's invariants on the target's state and the spec's operation on the state it was in;
each step by what must be cached (every computed full block), what may be evicted (only
as the spec evicts) and how long hits must be (against the kit's own shadow of the cache).
Exact targets (pagedkv, article) are compared block id for block id; the others are
checked on everything any block order must keep. A discrepancy is shrunk to its shortest
step sequence. See docs/conformance.md for the properties, the adapter contract and each
target's declared differences."""

EPILOG = """\
Your own allocator: --target package.module:factory, where factory() returns a fresh
adapter (docs/conformance.md, "Your own allocator"; the module is imported from the
current directory first). The factory and its adapter are checked before the first step.
Bundled targets whose package is missing are refused in one line.

Exit status: 0 every property held; 1 the target disagreed with the spec; 2 the command
or the adapter is at fault (one line); 130 interrupted."""


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    parser = OneLineParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--target",
        required=True,
        help=f"what to check: {', '.join(TARGETS)} (a name with several configurations "
        "splits the steps between them), or package.module:factory",
    )
    parser.add_argument(
        "--steps", type=int, default=2000, help="steps to run, at least (default 2000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--known-findings",
        action="store_true",
        help="bundled targets declare their findings (docs/findings/) as differences, so "
        "the run looks past them for other bugs (counted, not raised)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a progress line on stderr this often (default 10)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        return fail(prog, f"--steps must be at least 1, got {args.steps}")
    try:
        configurations = _configurations(args.target, args.known_findings)
    except TargetUnavailableError as error:
        return fail(prog, str(error))
    per_configuration = -(-args.steps // len(configurations))
    reports: list[Report] = []
    started = time.monotonic()
    try:
        for name, factory in configurations:
            try:
                report = check_target(
                    factory,
                    steps=per_configuration,
                    seed=args.seed,
                    progress=lambda r: _progress(r, per_configuration, started),
                    progress_every_s=args.progress_every,
                )
            except AdapterError as error:
                return fail(prog, f"{name}: {error}")
            reports.append(report)
            print(report.describe(), flush=True)
            if report.discrepancy is not None:
                return 1
    except TargetUnavailableError as error:
        return fail(prog, str(error))
    except RunInterrupted as stopped:
        done = sum(r.steps for r in reports) + stopped.report.steps
        print(f"{prog}: interrupted after {done} completed steps", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        done = sum(r.steps for r in reports)
        print(f"{prog}: interrupted after {done} completed steps", file=sys.stderr)
        return EXIT_INTERRUPTED
    total = sum(r.steps for r in reports)
    print(f"{args.target}: {total} steps, {time.monotonic() - started:.0f} s, all properties held")
    return 0


def _configurations(target: str, known_findings: bool) -> list[tuple[str, Factory]]:
    """The configurations ``target`` names: a bundled name's, or one ``module:factory``."""
    if target in TARGETS:
        return [(name, configuration(name, known_findings)) for name in TARGETS[target]]
    if ":" not in target:
        raise TargetUnavailableError(
            f"unknown target {target!r}; choose one of {', '.join(TARGETS)}, "
            "or name your adapter as package.module:factory"
        )
    return [(target, load_factory(target))]


def _progress(report: Report, steps: int, started: float) -> None:
    elapsed = time.monotonic() - started
    print(
        f"{report.target}: {report.steps}/{steps} steps, {report.cases} cases, "
        f"{elapsed:.0f} s, {report.steps / max(elapsed, 1e-9):.0f} steps/s",
        file=sys.stderr,
        flush=True,
    )
