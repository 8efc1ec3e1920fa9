"""``python -m harness.conformance``: run the conformance kit against a bundled target.

Exit 0 when every property held, 1 on a discrepancy (the shrunk steps, the target's and
the spec's side, bug or declared difference), 2 on bad input (one line), 130 on Ctrl-C.
"""

import sys
import time
from collections.abc import Sequence

from harness.cli.parsing import OneLineParser, fail
from harness.conformance.report import Report
from harness.conformance.run import check_target
from harness.conformance.targets import CONFIGURATIONS, TARGETS, TargetUnavailableError

PROG = "python -m harness.conformance"
EXIT_INTERRUPTED = 130

DESCRIPTION = """\
Check a KV-cache block allocator against pagedkv's executable spec with stateful random
testing (Hypothesis). Each step applies one of the spec's operations (admit a prompt with
prefix lookup, allocate or append, fork, release, preempt, truncate: those the target
supports) to the target, then checks the spec's invariants on the target's state and the
spec's operation on the state the target was in. Exact targets (pagedkv, article) are
compared block id for block id; the others (vllm, transformers) have their own block order
and are checked on everything any order must keep. A discrepancy is shrunk to its shortest
step sequence. See docs/conformance.md for the properties and each target's declared
differences."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument(
        "--target",
        required=True,
        help=f"what to check: {', '.join(TARGETS)} (a name with several configurations "
        "splits the steps between them)",
    )
    parser.add_argument(
        "--steps", type=int, default=2000, help="steps to run, at least (default 2000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a progress line on stderr this often (default 10)",
    )
    args = parser.parse_args(argv)
    if args.target not in TARGETS:
        return fail(PROG, f"unknown target {args.target!r}; choose one of {', '.join(TARGETS)}")
    if args.steps < 1:
        return fail(PROG, f"--steps must be at least 1, got {args.steps}")
    configurations = TARGETS[args.target]
    per_configuration = -(-args.steps // len(configurations))
    reports: list[Report] = []
    started = time.monotonic()
    try:
        for name in configurations:
            report = check_target(
                CONFIGURATIONS[name],
                steps=per_configuration,
                seed_value=args.seed,
                progress=lambda r: _progress(r, per_configuration, started),
                progress_every_s=args.progress_every,
            )
            reports.append(report)
            print(report.describe(), flush=True)
            if report.discrepancy is not None:
                return 1
    except TargetUnavailableError as error:
        return fail(PROG, str(error))
    except KeyboardInterrupt:
        done = sum(r.steps for r in reports)
        print(f"{PROG}: interrupted after {done} completed steps", file=sys.stderr)
        return EXIT_INTERRUPTED
    total = sum(r.steps for r in reports)
    print(f"{args.target}: {total} steps, {time.monotonic() - started:.0f} s, all properties held")
    return 0


def _progress(report: Report, steps: int, started: float) -> None:
    elapsed = time.monotonic() - started
    print(
        f"{report.target}: {report.steps}/{steps} steps, {report.cases} cases, "
        f"{elapsed:.0f} s, {report.steps / max(elapsed, 1e-9):.0f} steps/s",
        file=sys.stderr,
        flush=True,
    )
