"""The GPU check's engine-profile stage: where a bfloat16 run of the paged ``Engine`` spends
its time, and what SDPA's backend order does to it.

On SmolLM2's shapes (``random_smollm2``: the same calls and sizes as the real model), a
batch of ``plan.profile_batch`` requests of distinct prompt lengths decodes
``plan.profile_new_tokens`` tokens each: once to warm up, once in torch's own SDPA order,
once in the harness's (``harness.runtime.sdpa_order``), and once more in the harness's
order under ``torch.profiler``, whose table says how many kernels each engine step launches,
how often the host waits on the device, and how busy the device was.
"""

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from harness.bench.attention import synchronize
from harness.bench.decode_methods import run_engine_holding_all
from harness.gpu_check.gpu_plan import Json, Log, Plan
from harness.gpu_check.random_smollm2 import random_smollm2
from harness.models import LoadedModel
from harness.runtime.requests import Request
from harness.runtime.results import EngineResult
from harness.runtime.sdpa_order import describe_order, harness_sdpa_order

BLOCK_SIZE = 16
TOP_OPS = 12
# Host-side calls that launch a kernel, and ones where the host waits for the device.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense")


def stage_engine_profile(plan: Plan, log: Log) -> Json:
    """The engine's bf16 tokens/s in each SDPA order, and a profile of one run."""
    model = random_smollm2(plan.model_shape, torch.bfloat16, plan.device)
    loaded = LoadedModel(model=model, tokenizer=None, name="random-smollm2-shapes(seed=0)")
    generator = torch.Generator().manual_seed(2)
    vocab = plan.model_shape.vocab_size
    # Distinct lengths: no two requests share a shape, as in a real batch.
    requests = [
        Request(
            f"p{number}",
            tuple(torch.randint(vocab, (24 + 7 * number,), generator=generator).tolist()),
            plan.profile_new_tokens,
        )
        for number in range(plan.profile_batch)
    ]
    orders: dict[str, AbstractContextManager[None]] = {
        "warm_up": harness_sdpa_order(plan.device),
        "torch_order": nullcontext(),
        "harness_order": harness_sdpa_order(plan.device),
    }
    result: Json = {"status": "ok", "harness_order": describe_order()}
    for name, order in orders.items():
        with order:
            run = _run(loaded, requests, plan.device)
        result[f"{name}_tokens_per_s"] = round(run.generated_tokens / run.elapsed_s, 1)
        log(f"   {name}: {result[f'{name}_tokens_per_s']} tokens/s, {len(run.schedule)} steps")
    activities = [ProfilerActivity.CPU]
    if plan.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with harness_sdpa_order(plan.device), profile(activities=activities) as profiler:
        run = _run(loaded, requests, plan.device)
    result["profile"] = _summary(profiler.key_averages(), len(run.schedule), run.elapsed_s)
    log(f"   profile: {result['profile']}")
    return result


def _run(loaded: LoadedModel, requests: list[Request], device: torch.device) -> EngineResult:
    result = run_engine_holding_all(loaded, requests, BLOCK_SIZE)
    synchronize(device)
    return result


def _summary(
    averages: object,  # torch.autograd.profiler_util.EventList (untyped in torch)
    steps: int,
    elapsed_s: float,
) -> Json:
    events = list(averages)  # type: ignore[call-overload]
    by_name = {event.key: event for event in events}

    def calls(names: tuple[str, ...]) -> int:
        return sum(by_name[name].count for name in names if name in by_name)

    device_us = sum(_self_device_us(event) for event in events)
    top = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return {
        "steps": steps,
        "profiled_wall_ms_per_step": round(elapsed_s * 1000 / steps, 2),
        "kernel_launches_per_step": round(calls(LAUNCHES) / steps, 1),
        "host_waits_per_step": round(calls(WAITS) / steps, 1),
        "device_busy_ms_per_step": round(device_us / 1000 / steps, 3),
        "top_self_cpu": [
            {
                "op": event.key,
                "calls_per_step": round(event.count / steps, 1),
                "self_cpu_ms_per_step": round(event.self_cpu_time_total / 1000 / steps, 3),
            }
            for event in top
        ],
    }


def _self_device_us(event: object) -> float:
    """An op's own device time in us (torch renamed ``self_cuda_time_total`` in 2.4)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0
