"""The GPU check's stages (``scripts/gpu_check.py`` drives them): each takes the run's
``Plan`` and a log, returns its JSON-ready result with a ``status``, and raises only on a
bug (the driver records the error and goes on).

``FULL`` is the GPU run, ``SMOKE`` the CPU minute CI runs. Stages, most important first:
the environment, the CUDA tests' cases (``harness.oracle.device_cases``), where a bf16
engine run's time goes (``harness.gpu_check.gpu_profile``), the three checks,
the kernels against SDPA, the bf16 decode benchmark.
"""

import contextlib
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from harness.bench import attention as bench_attention
from harness.bench import decode as bench_decode
from harness.gpu_check import gpu_plan
from harness.gpu_check.gpu_plan import DTYPES, FULL, KERNEL_TOLERANCE, Json, Log, Plan
from harness.gpu_check.gpu_profile import stage_engine_profile
from harness.gpu_check.random_smollm2 import random_smollm2
from harness.gpu_check.sdpa_probe import sdpa_backends, sdpa_new_shape_cost
from harness.models import LoadedModel, ModelNotFoundError, kv_layout, load_model
from harness.oracle.device_cases import (
    paged_cache_generate_failures,
    paged_equals_dense_failures,
)
from harness.oracle.equivalence import (
    EquivalenceReport,
    PoolConfig,
    run_equivalence,
    tight_total_blocks,
)
from harness.prompts import BUILTIN_PROMPTS, render_prompt
from harness.runtime.attention_backends import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionBackendError,
)
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PoisonedKVPool
from harness.runtime.requests import Request
from harness.runtime.varlen_kernel import varlen_signature, varlen_takes_block_table

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
        "sdpa_backends": sdpa_backends(plan.device),
        "sdpa_backends_harness_order": sdpa_backends(plan.device, harness_order=True),
        "sdpa_new_shape_cost": sdpa_new_shape_cost(plan.device),
        "varlen_attn": varlen_signature(),
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


def stage_checks(plan: Plan, log: Log) -> Json:
    """The three checks for bfloat16/float32 x packed/batch-invariant, poisoned pool; and
    the packed engine preempting by swap to a host tier (pinned memory on CUDA)."""
    runs: dict[str, Json] = {}
    for dtype_name, dtype in DTYPES.items():
        loaded = _checks_model(plan, dtype, log)
        requests = _checks_requests(loaded, plan)
        blocks = tight_total_blocks(requests, 16)
        for engine_type, preemption in gpu_plan.CHECK_RUNS:
            swap = preemption == "swap"
            pool = PoolConfig(
                total_blocks=blocks,
                block_size=16,
                engine_type=engine_type,
                pool_type=PoisonedKVPool,
                preemption=preemption,
                host_blocks=blocks if swap else 0,
            )
            name = f"{dtype_name}/{engine_type.__name__}" + ("/swap" if swap else "")
            runs[name] = _checks_run(loaded, requests, pool)
            if not runs[name]["passed"]:
                # NOTE: once more in the same process, recorded beside it (the run still
                # fails): a failure that does not recur points at the process's state, as
                # on the H200 (2026-12-04), where SDPA's backend changed after the first
                # run (harness/runtime/sdpa_order.py).
                runs[name]["repeat"] = _checks_run(loaded, requests, pool)
            log(f"   {name}: {json.dumps(runs[name])[:900]}")
        for kernel in plan.check_kernels:
            named = _kernel_checks_run(loaded, requests, blocks, kernel, log)
            if named is not None:
                runs[named[0]] = named[1]
    status = "ok" if all(run["passed"] for run in runs.values()) else "failed"
    return {"status": status, "runs": runs}


def _kernel_checks_run(
    loaded: LoadedModel, requests: list[Request], blocks: int, kernel: str, log: Log
) -> tuple[str, Json] | None:
    """The three checks with ``kernel`` computing the paged runs' attention (``Engine``,
    recompute), named; ``None`` where the backend refuses this machine (logged)."""
    backend = ATTENTION_BACKENDS[kernel]
    layout = kv_layout(loaded)
    name = f"{str(layout.dtype).removeprefix('torch.')}/Engine/{kernel}"
    try:
        backend.check(loaded.model, layout, 16)
    except AttentionBackendError as error:
        log(f"   {name} skipped: {error}")
        return None
    pool = PoolConfig(
        total_blocks=blocks,
        block_size=16,
        engine_type=Engine,
        pool_type=backend.poisoned_pool_type,
        attention=backend,
    )
    result = _checks_run(loaded, requests, pool)
    log(f"   {name}: {json.dumps(result)[:900]}")
    return name, result


def _checks_run(loaded: LoadedModel, requests: list[Request], pool: PoolConfig) -> Json:
    started = time.perf_counter()
    with _deterministic():
        report = run_equivalence(loaded, requests, pool, lambda _: None)
    # The run's wall time, dense references included: what sizes the next plan.
    return _checks_summary(loaded.name, report) | {
        "seconds": round(time.perf_counter() - started, 2)
    }


def _checks_model(plan: Plan, dtype: torch.dtype, log: Log) -> LoadedModel:
    """The bundled SmolLM2 when it loads here (not in smoke runs), else the random one;
    the log says why the bundled one did not load."""
    if plan.device.type == "cuda":
        try:
            return load_model(None, plan.device, dtype)
        except (ModelNotFoundError, ImportError, OSError) as error:  # a bare machine
            reason = str(error).splitlines()[0] if str(error) else ""
            log(f"   bundled SmolLM2 not loaded ({type(error).__name__}: {reason}): random shapes")
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
        "swaps_out": report.host.swaps_out,
    }


# -- stage 4: the attention read ------------------------------------------------------------


def stage_kernels(plan: Plan, log: Log) -> Json:
    """Each attention backend's decode step at SmolLM2's shapes against SDPA on contiguous
    K/V: agreement, a NaN (and a finite) poison in the rows past each request's tokens, one
    request alone vs in the batch, and the time per call. ``varlen`` needs CUDA and a
    torch whose ``varlen_attn`` takes a block table (skipped without them, the log says
    why), ``flex`` runs on CPU only (``flex_limits``); fp32 is gather's and flex's only
    (FlashAttention is fp16/bf16)."""
    shapes: dict[str, Json] = {}
    passed = True
    cuda, block_table = _has_cuda(plan), varlen_takes_block_table()
    varlen_runs = cuda and block_table
    runs = {"varlen": varlen_runs, "flex": not cuda}  # flex_limits refuses CUDA
    backends = [name for name in plan.kernel_backends if runs.get(name, True)]
    if "varlen" in plan.kernel_backends and not varlen_runs:
        log(f"   varlen skipped: CUDA {cuda}, block table {block_table}")
    if "flex" in plan.kernel_backends and cuda:
        log("   flex skipped: CUDA (its mask's query block size of 1 does not lower there)")
    for batch, context in plan.kernel_shapes:
        for dtype_name, dtype in DTYPES.items():
            for backend in backends:
                if backend == "varlen" and dtype == torch.float32:
                    continue
                if backend == "triton" and not cuda and dtype != torch.float32:
                    continue  # Triton's interpreter computes float32 only
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
    loaded = _checks_model(plan, torch.bfloat16, log)
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
        _decode_attention(plan, loaded, log),
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


def _decode_attention(plan: Plan, loaded: LoadedModel, log: Log) -> AttentionBackend:
    """The plan's attention for the paged engine, or gather where this machine refuses it."""
    backend = ATTENTION_BACKENDS[plan.decode_attention]
    try:
        backend.check(loaded.model, kv_layout(loaded), 16)
    except AttentionBackendError as error:
        log(f"   paged decode on gather: {error}")
        return ATTENTION_BACKENDS["gather"]
    return backend


# The stages in priority order, by the name ``--skip`` takes.
STAGES: dict[str, Callable[[Plan, Log], Json]] = {
    "environment": stage_environment,
    "device_tests": stage_device_tests,
    "engine_profile": stage_engine_profile,
    "checks": stage_checks,
    "kernels": stage_kernels,
    "decode_bench": stage_decode_bench,
}
