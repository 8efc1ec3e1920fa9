#!/usr/bin/env python3
"""The GPU check: one driver, stages in priority order under one deadline, one JSON, one log.

Runs in a person's ``.venv`` on an A100/H100 (``python scripts/gpu_check.py``) and on a bare
GPU machine that has only ``python3`` with torch and an older transformers. For the bare
machine, carry the pinned transformers wheel, fetched once here into the git-ignored
``.whl/``, and install it there into the git-ignored ``.site/``, which this script puts
first on ``sys.path``:

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0
    python3 -m pip install --no-index --no-deps --target .site .whl/*.whl   # on the GPU machine
    python3 scripts/gpu_check.py

Results go under ``--out``, else ``$OUT``, else a new temporary folder (printed first, never
in the repository): ``gpu_check.json`` (rewritten whole after each stage; ``null`` where a
figure is NaN) and ``gpu_check.log``, nothing else. Stages, most important first; a stage
that would start after ``--deadline-s`` is recorded as skipped and fails the run, one named
by ``--skip`` does not:
1. ``environment``: versions, the GPU, which SDPA backend each of our call shapes gets,
   whether ``torch.nn.attention.varlen.varlen_attn`` takes a ``block_table``;
2. ``device_tests``: the CUDA tests' cases (``harness/oracle/device_cases.py``), no pytest;
3. ``engine_profile``: a bf16 ``Engine`` run at SmolLM2's shapes, tokens/s in torch's SDPA
   order and in the harness's (cuDNN off: ``harness/runtime/sdpa_order.py``), and
   ``torch.profiler``'s kernel launches, host waits and device time per step;
4. ``checks``: the three checks for bfloat16/float32 x ``Engine``/``BatchInvariantEngine``,
   ``Engine`` preempting by swap to a host tier (pinned memory) and ``Engine`` with the
   Triton kernel (``--attention triton``), on the bundled
   SmolLM2 when it loads here, else on a seeded random model of its exact
   shapes (``random_smollm2``; the log says why), with every tie's margin in ulps; a run
   that fails is run once more and the repeat recorded beside it;
5. ``kernels``: each attention backend (gather, varlen, flex, triton; ``--attention``) at
   SmolLM2's shapes, B = 8 at 512 tokens and B = 64 at 4096, against SDPA on contiguous
   K/V: agreement, NaN (and finite) poison past each request's tokens, a request alone vs
   in the batch, ms per decode call (flex on CPU only: ``flex_limits``);
6. ``decode_bench``: bf16 decode tokens/s, paged engine (on the Triton kernel where it
   runs, else gather) and HF ``generate_batch`` vs dense ``generate``
   (``harness.bench.decode``).
``--smoke`` runs every stage on CPU with a scaled-down model in about a minute; CI runs it
(``tests/harness/test_gpu_check.py``), so a GPU run is never lost to a typo.
Exit 0 when every stage asked for ran and passed, 1 when one failed or did not run, 2 on bad
input (one line) or without a CUDA device (and no --smoke), 130 on Ctrl-C (one line; the JSON
keeps the stages that finished, the interrupted one marked, and says ``"passed": false``).
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# .site first: the carried transformers must win over the machine's older one.
for _path in (REPO, REPO / ".site"):
    if _path.is_dir() and str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
# Before torch touches CUDA: check 2 on CUDA needs deterministic cuBLAS.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# --smoke runs the Triton kernel on CPU, in Triton's interpreter: a mode fixed when triton is
# first imported, so chosen here, before anything imports it.
if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from harness.gpu_check.gpu_plan import FULL, SMOKE, Json, Plan  # noqa: E402
from harness.gpu_check.gpu_stages import STAGES as STAGE_FUNCTIONS  # noqa: E402
from harness.parsing import OneLineParser, UsageError, fail  # noqa: E402

STAGES = tuple(STAGE_FUNCTIONS)


class Log:
    """Every line both to stdout and to the log file."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w", encoding="utf-8")

    def __call__(self, message: str) -> None:
        print(message, flush=True)
        self.file.write(message + "\n")
        self.file.flush()


PROG = "scripts/gpu_check.py"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    """The driver's options."""
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="every stage on CPU, small")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=540.0,
        help="no stage starts after this many seconds (540); a stage it cuts off fails the run",
    )
    parser.add_argument(
        "--skip",
        action="append",
        choices=STAGES,
        default=[],
        metavar="STAGE",
        help=f"a stage not to run, not counted as a failure (repeatable; one of {STAGES})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default $OUT, else a new temporary folder)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the stages in order; write the JSON and the log; 0 when every stage asked for
    ran and passed, 1 when one failed or did not run, 2 on bad input, 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    if not args.deadline_s > 0:  # also refuses nan
        return fail(PROG, f"--deadline-s must be > 0 seconds, got {args.deadline_s}")
    if set(args.skip) == set(STAGES):
        return fail(PROG, "--skip names every stage: nothing would be checked")
    try:
        out, chosen = _results_folder(args.out)
        log = Log(out / "gpu_check.log")
    except UsageError as error:
        return fail(PROG, str(error))
    log(f"gpu_check: results in {out} ({chosen})")
    plan = SMOKE if args.smoke else FULL
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        log("gpu_check: no CUDA device here; use --smoke for the CPU run")
        return 2
    if plan.cpu_threads is not None:
        torch.set_num_threads(plan.cpu_threads)
    run = Run(out, {"mode": "smoke" if args.smoke else "gpu", "deadline_s": args.deadline_s})
    try:
        for name in STAGES:
            elapsed = run.elapsed_s()
            if name in args.skip:
                run.record(name, {"status": "skipped", "why": "--skip"})
                log(f"== {name}: skipped (--skip)")
            elif elapsed > args.deadline_s:
                run.record(name, {"status": "skipped", "why": f"deadline at {elapsed:.0f} s"})
                log(f"== {name}: skipped (deadline, {elapsed:.0f} s): the run fails")
            else:
                log(f"== {name} (at {elapsed:.0f} s)")
                run.current = name
                run.record(name, _run_stage(STAGE_FUNCTIONS[name], plan, log))
    except KeyboardInterrupt:
        if run.current not in run.stages:  # not when Ctrl-C came just after it was recorded
            run.record(run.current, {"status": "interrupted"})
        run.finish(args.skip)
        log(f"gpu_check: interrupted in stage {run.current}; the stages before it are in {out}")
        return EXIT_INTERRUPTED
    failed = run.finish(args.skip)
    log(f"gpu_check: {'PASS' if not failed else 'FAIL ' + ', '.join(failed)}; results in {out}")
    return 0 if not failed else 1


def _results_folder(out: Path | None) -> tuple[Path, str]:
    """The folder to write into, created, and which rule chose it; ``UsageError`` if none can."""
    if out is not None:
        chosen = "--out"
    elif os.environ.get("OUT"):
        out, chosen = Path(os.environ["OUT"]), "$OUT"
    else:
        # Never into the repository: a run must not leave files where git sees them.
        return Path(tempfile.mkdtemp(prefix="gpu_check-")), "no --out and no $OUT"
    if out.exists() and not out.is_dir():
        raise UsageError(f"{chosen} {str(out)!r} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"cannot create the results folder {str(out)!r}: {error.strerror or error}"
        ) from error
    return out, chosen


class Run:
    """The results so far, rewritten whole into ``gpu_check.json`` after every stage."""

    def __init__(self, out: Path, header: Json) -> None:
        self.out = out
        self.header = header
        self.stages: dict[str, object] = {}
        self.current = STAGES[0]  # the stage running (or last run)
        self.started = time.perf_counter()

    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def record(self, name: str, result: object) -> None:
        """Keep ``name``'s result and rewrite the JSON (a run cut off keeps what it did)."""
        self.stages[name] = result
        self._write({})

    def finish(self, skipped: list[str]) -> list[str]:
        """Write the verdict: the stages asked for (not ``skipped``) that did not run and
        pass; returned, so an empty list is a pass."""
        failed = [
            name
            for name in STAGES
            if name not in skipped and _status(self.stages.get(name)) != "ok"
        ]
        self._write({"failed_stages": failed, "passed": not failed})
        return failed

    def _write(self, verdict: Json) -> None:
        results = self.header | {"stages": self.stages, "elapsed_s": self.elapsed_s()} | verdict
        # allow_nan=False: strict parsers refuse NaN; _finite has written null for it.
        text = json.dumps(_finite(results), indent=2, default=str, allow_nan=False) + "\n"
        # Written aside, then renamed over: Ctrl-C or the machine's limit never leaves half.
        partial = self.out / "gpu_check.json.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(self.out / "gpu_check.json")


def _finite(value: object) -> object:
    """``value`` with every NaN and infinity (invalid JSON) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _run_stage(
    stage: Callable[[Plan, Callable[[str], None]], Json], plan: Plan, log: "Log"
) -> object:
    """One stage, timed; an exception is the stage's error, logged, and the next one runs."""
    started = time.perf_counter()
    try:
        result = stage(plan, log)
    except Exception as error:
        log(traceback.format_exc())
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"}
    result["seconds"] = round(time.perf_counter() - started, 2)
    log(f"   {result['status']} in {result['seconds']} s")
    return result


def _status(result: object) -> str:
    return str(result.get("status")) if isinstance(result, dict) else "not run"


if __name__ == "__main__":
    sys.exit(main())
