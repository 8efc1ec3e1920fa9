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
3. ``checks``: the three checks for float32/bfloat16 x ``Engine``/``BatchInvariantEngine``
   on the bundled SmolLM2 when it loads here, else on a seeded random model of its exact
   shapes (``random_smollm2``), with every tie's margin in ulps;
4. ``kernels``: each attention backend (gather, varlen, flex; ``--attention``) at
   SmolLM2's shapes, B = 8 at 512 tokens and B = 64 at 4096, against SDPA on contiguous
   K/V: agreement, NaN (and finite) poison past each request's tokens, a request alone vs
   in the batch, ms per decode call;
5. ``decode_bench``: bf16 decode tokens/s, paged engine and HF ``generate_batch`` vs dense
   ``generate`` (``harness.bench.decode``).
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

import argparse  # noqa: E402
import contextlib  # noqa: E402
import inspect  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from harness.bench import attention as bench_attention  # noqa: E402
from harness.bench import decode as bench_decode  # noqa: E402
from harness.cli.parsing import OneLineParser, UsageError, fail  # noqa: E402
from harness.models import LoadedModel, ModelNotFoundError, load_model  # noqa: E402
from harness.oracle.device_cases import (  # noqa: E402
    paged_cache_generate_failures,
    paged_equals_dense_failures,
)
from harness.oracle.equivalence import (  # noqa: E402
    EquivalenceReport,
    PoolConfig,
    run_equivalence,
    tight_total_blocks,
)
from harness.prompts import BUILTIN_PROMPTS, render_prompt  # noqa: E402
from harness.runtime.engine import BatchInvariantEngine, Engine  # noqa: E402
from harness.runtime.kv_pool import PoisonedKVPool  # noqa: E402
from harness.runtime.requests import Request  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Json = dict[str, object]  # what a stage reports: JSON-ready values
# How far the paged read may drift from SDPA on contiguous K/V before the kernels stage
# fails: a few output ulps (outputs are O(1)). Bitwise equality is reported beside it.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
STAGES = ("environment", "device_tests", "checks", "kernels", "decode_bench")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a Llama; SmolLM2-135M's are the defaults."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64


@dataclass(frozen=True, slots=True)
class Plan:
    """How big each stage runs: the full GPU run or the CPU smoke run."""

    device: torch.device
    model_shape: ModelShape  # of the random model
    device_test_requests: int
    cpu_threads: int | None  # None: torch's default
    requests: int
    max_new_tokens: int
    kernel_shapes: tuple[tuple[int, int], ...]  # (batch, context tokens)
    kernel_backends: tuple[str, ...]
    kernel_repeats: int
    bench_batch_sizes: tuple[int, ...]
    bench_new_tokens: int
    bench_repeats: int


SMOLLM2_SHAPE = ModelShape()
# Same heads (9 over 3), so GQA runs as in SmolLM2; small enough for a CPU minute.
SMOKE_SHAPE = ModelShape(
    vocab_size=512, hidden_size=144, intermediate_size=128, num_hidden_layers=2, head_dim=16
)

FULL = Plan(
    device=torch.device("cuda"),
    model_shape=SMOLLM2_SHAPE,
    device_test_requests=6,
    cpu_threads=None,
    requests=14,
    max_new_tokens=64,
    kernel_shapes=((8, 512), (64, 4096)),
    kernel_backends=("gather", "varlen", "flex"),
    kernel_repeats=20,
    bench_batch_sizes=(1, 8, 32),
    bench_new_tokens=64,
    bench_repeats=3,
)
SMOKE = Plan(
    device=torch.device("cpu"),
    model_shape=SMOKE_SHAPE,
    device_test_requests=3,
    cpu_threads=1,  # per-request attention is many small ops: one thread wins on CPU
    requests=4,
    max_new_tokens=6,
    kernel_shapes=((2, 48),),
    # NOTE: not flex: its first compile takes minutes on a 2-core CPU (the smoke run is CI's).
    kernel_backends=("gather", "varlen-emulated", "varlen"),
    kernel_repeats=2,
    bench_batch_sizes=(2,),
    bench_new_tokens=3,
    bench_repeats=1,
)


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
    stages: dict[str, Callable[[Plan, Log], Json]] = {
        "environment": stage_environment,
        "device_tests": stage_device_tests,
        "checks": stage_checks,
        "kernels": stage_kernels,
        "decode_bench": stage_decode_bench,
    }
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
                run.record(name, _run_stage(stages[name], plan, log))
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


def _run_stage(stage: Callable[[Plan, Log], Json], plan: Plan, log: Log) -> object:
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


# -- stage 1: environment -------------------------------------------------------------------


def stage_environment(plan: Plan, log: Log) -> Json:
    """Versions, the device, SDPA's backend per call shape, ``varlen_attn``'s signature."""
    env: Json = {
        "status": "ok",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "transformers_path": str(Path(transformers.__file__).parent),
        "cpu_count": os.cpu_count(),
        "device": _device_text(plan.device),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "sdpa_backends": _sdpa_backends(plan.device),
        "varlen_attn": _varlen_signature(),
    }
    for key, value in env.items():
        log(f"   {key}: {value}")
    return env


def _device_text(device: torch.device) -> str:
    if device.type != "cuda":
        return f"cpu ({platform.processor() or platform.machine()})"
    properties = torch.cuda.get_device_properties(device)
    return (
        f"{properties.name}, capability {properties.major}.{properties.minor}, "
        f"{properties.total_memory / 2**30:.0f} GiB"
    )


def _sdpa_backends(device: torch.device) -> dict[str, str]:
    """Which SDPA backend torch picks for each call our attention makes, bf16 and fp32.

    SmolLM2's shapes: 9 query heads over 3 KV heads of 64. The calls: a whole prefill
    (``is_causal``), a one-query decode, a partial prefill with a bottom-right bool mask.
    """
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa  # noqa: PLC0415

    # Any: torch's pybind SDPBackend enum members.
    names = {int(value): name for name, value in _sdp_backend_members().items()}
    chosen: dict[str, str] = {}
    for dtype_name, dtype in DTYPES.items():
        for shape, (queries, keys, masked, causal) in {
            "prefill_256": (256, 256, False, True),
            "decode_1_of_512": (1, 512, False, False),
            "partial_prefill_16_of_512": (16, 512, True, False),
        }.items():
            query = torch.randn(1, 9, queries, 64, dtype=dtype, device=device)
            key = torch.randn(1, 3, keys, 64, dtype=dtype, device=device)
            mask = None
            if masked:
                mask = torch.ones(queries, keys, dtype=torch.bool, device=device)
                mask = mask.tril(keys - queries)[None, None]
            gqa = bool(use_gqa_in_sdpa(mask, key, key))
            if not gqa:  # HF's wrapper repeats the KV heads instead
                key = key.repeat_interleave(3, dim=1)
            try:
                choice = torch._fused_sdp_choice(
                    query, key, key, mask, 0.0, causal, scale=None, enable_gqa=gqa
                )
                chosen[f"{dtype_name}/{shape}"] = f"{names.get(int(choice), choice)} (gqa={gqa})"
            except Exception as error:  # a private API: report, never fail the stage on it
                chosen[f"{dtype_name}/{shape}"] = f"unknown: {type(error).__name__}: {error}"
    return chosen


def _sdp_backend_members() -> dict[str, Any]:  # Any: torch's pybind enum members
    try:
        from torch.nn.attention import SDPBackend  # noqa: PLC0415

        members: dict[str, Any] = dict(SDPBackend.__members__)
        return members
    except (ImportError, AttributeError):
        return {}


def _varlen_signature() -> Json:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
    except ImportError as error:
        return {"available": False, "why": str(error)}
    parameters = inspect.signature(varlen_attn).parameters
    return {"available": True, "takes_block_table": "block_table" in parameters}


# -- stage 2: the CUDA tests' cases ---------------------------------------------------------


def stage_device_tests(plan: Plan, log: Log) -> Json:
    """The cases ``tests/harness/test_cuda.py`` asserts, run without pytest."""
    cases: dict[str, list[str]] = {}
    with _deterministic():
        for dtype_name, dtype in DTYPES.items():
            for engine_type in (Engine, BatchInvariantEngine):
                name = f"paged_equals_dense/{dtype_name}/{engine_type.__name__}"
                cases[name] = paged_equals_dense_failures(
                    plan.device, dtype, engine_type, plan.device_test_requests
                )
            cases[f"paged_cache_generate/{dtype_name}"] = paged_cache_generate_failures(
                plan.device, dtype
            )
    for name, failures in cases.items():
        log(f"   {name}: {'ok' if not failures else 'FAIL ' + '; '.join(failures)[:300]}")
    status = "ok" if not any(cases.values()) else "failed"
    return {"status": status, "cases": {name: failures or "ok" for name, failures in cases.items()}}


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    # warn_only: an op without a deterministic kernel warns (in the log) instead of raising.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


# -- stage 3: the three checks on SmolLM2 (or its shapes) ----------------------------------


def random_smollm2(
    shape: ModelShape, dtype: torch.dtype, device: torch.device
) -> Any:  # Any: a transformers LlamaForCausalLM
    """A seeded random Llama of ``shape`` whose logits look like a trained model's.

    NOTE: default init gives near-uniform logits (argmax ties everywhere). A gain of
    1.5/sqrt(fan_in) on every matrix and embeddings of std 0.3 gave a median top-1 logit of
    29.5 at SmolLM2's shapes, against 28.2 for the real model, so the bf16 grid spacing
    at the top-1 logit (what the tie rule counts in) is the real run's.
    Built in float32 from a CPU seed, then loaded into a model made with ``dtype=`` as
    ``from_pretrained`` makes it: the rotary ``inv_freq`` stays float32.
    """
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    source = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if "embed_tokens" in name:
                parameter.normal_(0.0, 0.3)
            elif parameter.dim() == 2:
                parameter.normal_(0.0, 1.5 / math.sqrt(parameter.shape[1]))
    model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.load_state_dict(source.state_dict())
    model.to(device)
    model.eval()
    model.set_attn_implementation("sdpa")
    return model


def stage_checks(plan: Plan, log: Log) -> Json:
    """The three checks for float32/bfloat16 x packed/batch-invariant, poisoned pool."""
    runs: dict[str, Json] = {}
    for dtype_name, dtype in DTYPES.items():
        loaded = _checks_model(plan, dtype)
        requests = _checks_requests(loaded, plan)
        for engine_type in (Engine, BatchInvariantEngine):
            pool = PoolConfig(
                total_blocks=tight_total_blocks(requests, 16),
                block_size=16,
                engine_type=engine_type,
                pool_type=PoisonedKVPool,
            )
            with _deterministic():
                report = run_equivalence(loaded, requests, pool, lambda _: None)
            name = f"{dtype_name}/{engine_type.__name__}"
            runs[name] = _checks_summary(loaded.name, report)
            log(f"   {name}: {json.dumps(runs[name])[:600]}")
    status = "ok" if all(run["passed"] for run in runs.values()) else "failed"
    return {"status": status, "runs": runs}


def _checks_model(plan: Plan, dtype: torch.dtype) -> LoadedModel:
    """The bundled SmolLM2 when it loads here (not in smoke runs), else the random one."""
    if plan.device.type == "cuda":
        try:
            return load_model(None, plan.device, dtype)
        except (ModelNotFoundError, ImportError, OSError):
            pass  # a bare machine: no GGUF, no gguf package
    model = random_smollm2(plan.model_shape, dtype, plan.device)
    return LoadedModel(model=model, tokenizer=None, name="random-smollm2-shapes(seed=0)")


def _checks_requests(loaded: LoadedModel, plan: Plan) -> list[Request]:
    """The built-in prompts when there is a tokenizer; else seeded random prompts of their
    lengths' range (31 to 370 tokens), arriving two steps apart."""
    if loaded.tokenizer is not None:
        prompts = [render_prompt(loaded.tokenizer, messages) for messages in BUILTIN_PROMPTS]
    else:
        generator = torch.Generator().manual_seed(1)
        vocab = loaded.model.config.vocab_size
        lengths = [31, 37, 40, 43, 67, 208, 370] if plan is FULL else [5, 9, 13]
        prompts = [
            tuple(torch.randint(vocab, (lengths[i % len(lengths)],), generator=generator).tolist())
            for i in range(plan.requests)
        ]
    return [
        Request(f"r{number:02d}", prompt, plan.max_new_tokens, arrival_step=2 * number)
        for number, prompt in enumerate(prompts[: plan.requests])
    ]


def _checks_summary(model_name: str, report: EquivalenceReport) -> Json:
    rows = report.rows
    return {
        "model": model_name,
        "passed": report.passed,
        "rows_passing": f"{sum(row.passed for row in rows)}/{len(rows)}",
        "schedules_equal": report.schedules_equal,
        "tie_rule": report.tie_rule.describe(),
        "ties_ulps": [row.batch.margin_ulps for row in rows if row.batch.tie],
        "failures": [
            check.detail
            for row in rows
            for check in (row.gate, row.alone, row.batch)
            if not check.passed
        ],
        "max_logprob_delta": max(row.max_logprob_delta for row in rows),
        "paged_tokens_per_s": report.paged_tokens_per_s,
    }


# -- stage 4: the attention read ------------------------------------------------------------


def stage_kernels(plan: Plan, log: Log) -> Json:
    """Each attention backend's decode step at SmolLM2's shapes against SDPA on contiguous
    K/V: agreement, a NaN (and a finite) poison in the rows past each request's tokens, one
    request alone vs in the batch, and the time per call. ``varlen`` needs CUDA (skipped
    without it); fp32 is gather's and flex's only (FlashAttention is fp16/bf16)."""
    shapes: dict[str, Json] = {}
    passed = True
    backends = [name for name in plan.kernel_backends if name != "varlen" or _has_cuda(plan)]
    for batch, context in plan.kernel_shapes:
        for dtype_name, dtype in DTYPES.items():
            for backend in backends:
                if backend == "varlen" and dtype == torch.float32:
                    continue
                name = f"{backend}/{dtype_name}/B{batch}x{context}"
                agreement = _kernel_agreement_and_time(plan, backend, batch, context, dtype)
                passed = passed and agreement.passed(backend, dtype)
                shapes[name] = agreement.as_json()
                log(f"   {name}: {shapes[name]}")
    return {"status": "ok" if passed else "failed", "backends": backends, "shapes": shapes}


def _has_cuda(plan: Plan) -> bool:
    return plan.device.type == "cuda"


@dataclass(frozen=True, slots=True)
class Agreement:
    """A backend's decode step against SDPA on contiguous K/V, and its time.

    ``nan_tail_clean`` / ``finite_tail_clean``: no NaN in the output with NaN / the
    dtype's largest finite value in every row past each request's tokens (flex reads
    those rows: its pool poisons with the finite value). ``alone_equals_batched``:
    request 0 alone gives the bits it gives in the batch.
    """

    bitwise_equal: bool
    max_abs_diff: float
    nan_tail_clean: bool
    finite_tail_clean: bool
    alone_equals_batched: bool
    median_ms: float

    def passed(self, backend: str, dtype: torch.dtype) -> bool:
        """Within tolerance and clean under the poison its pool uses."""
        clean = self.finite_tail_clean if backend == "flex" else self.nan_tail_clean
        return clean and self.max_abs_diff <= KERNEL_TOLERANCE[dtype]

    def as_json(self) -> Json:
        """The fields, for the results file."""
        return {
            "bitwise_equal": self.bitwise_equal,
            "max_abs_diff": self.max_abs_diff,
            "nan_tail_clean": self.nan_tail_clean,
            "finite_tail_clean": self.finite_tail_clean,
            "alone_equals_batched": self.alone_equals_batched,
            "median_ms": round(self.median_ms, 4),
        }


def _kernel_agreement_and_time(
    plan: Plan, backend: str, batch: int, context: int, dtype: torch.dtype
) -> Agreement:
    # NOTE: FlashAttention's block table wants blocks of a multiple of 256 tokens; every
    # backend reads the same pool, so all run at 256 on CUDA (16 on the CPU smoke run).
    block_size = 256 if _has_cuda(plan) else 16
    case = bench_attention.decode_case(plan.device, dtype, batch, context, block_size)
    with torch.no_grad():
        ours, reference = case.decode(backend, batch), case.contiguous()
        alone = case.decode(backend, 1)
        _, call = case.step(backend, batch)
        times = [bench_attention.timed(call, plan.device) for _ in range(plan.kernel_repeats)]
        case.poison_tails(torch.finfo(dtype).max)
        finite_clean = not bool(case.decode(backend, batch).isnan().any())
        case.poison_tails(float("nan"))
        nan_clean = not bool(case.decode(backend, batch).isnan().any())
    difference = (ours.float() - reference.float()).abs().max()
    return Agreement(
        bool(torch.equal(ours, reference)),
        float(difference),
        nan_tail_clean=nan_clean,
        finite_tail_clean=finite_clean,
        alone_equals_batched=bool(torch.equal(alone[:, 0], ours[:, 0])),
        median_ms=1000 * statistics.median(times),
    )


# -- stage 5: the decode benchmark ----------------------------------------------------------


def stage_decode_bench(plan: Plan, log: Log) -> Json:
    """bf16 decode tokens/s: dense ``generate``, the paged engine, HF ``generate_batch``."""
    loaded = _checks_model(plan, torch.bfloat16)
    if loaded.tokenizer is not None:
        prompts = [render_prompt(loaded.tokenizer, messages) for messages in BUILTIN_PROMPTS]
    else:
        prompts = [request.prompt_ids for request in _checks_requests(loaded, plan)]
    prompts = [prompts[i % len(prompts)] for i in range(max(plan.bench_batch_sizes))]
    settings = bench_decode.Settings(
        list(plan.bench_batch_sizes),
        plan.bench_new_tokens,
        16,
        plan.bench_repeats,
        {"dense", "paged", "hf-cb"},
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = bench_decode.run_benchmark(loaded, prompts, settings)
    for line in printed.getvalue().splitlines():
        log(f"   {line}")
    result = bench_decode.as_json(rows, loaded, None)
    paged = [row for row in rows if row.method == "paged"]
    result["status"] = "ok" if paged else "failed"
    return result


if __name__ == "__main__":
    sys.exit(main())
