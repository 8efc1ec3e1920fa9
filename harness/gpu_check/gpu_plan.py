"""What the GPU check runs, and how big: ``FULL`` (the GPU run) and ``SMOKE`` (the CPU
minute CI runs), the dtypes, the engines and preemptions of the checks, the kernels'
tolerance, the random model's shapes."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.preemption import PreemptMode

Log = Callable[[str], None]  # where a stage writes its lines

# bfloat16 first: the main case (users run on GPUs in bf16), so a run cut short has it.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The engine and preemption of each run of the three checks (by swap: a host tier as large
# as the pool, pinned memory on CUDA).
CHECK_RUNS: tuple[tuple[type[Engine], PreemptMode], ...] = (
    (Engine, "recompute"),
    (BatchInvariantEngine, "recompute"),
    (Engine, "swap"),
)
Json = dict[str, object]  # what a stage reports: JSON-ready values
# How far the paged read may drift from SDPA on contiguous K/V before the kernels stage
# fails: a few output ulps (outputs are O(1)). Bitwise equality is reported beside it.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


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
    # Besides gather, the kernel backends the three checks also run with (``Engine``,
    # recompute), and the paged engine's attention in the decode benchmark.
    check_kernels: tuple[str, ...]
    decode_attention: str
    bench_batch_sizes: tuple[int, ...]
    bench_new_tokens: int
    bench_repeats: int
    profile_batch: int  # the engine-profile stage's requests
    profile_new_tokens: int


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
    # NOTE: 7 x 32, not the main job's 14 x 64: on the H200 (2026-12-04) 14 x 64 ran the
    # three float32 runs and not the bfloat16 ones in 540 s (paged 16-39 tokens/s: one
    # engine step is many small launches), and a lent GPU has 15 minutes in all.
    requests=7,
    max_new_tokens=32,
    kernel_shapes=((8, 512), (64, 4096)),
    kernel_backends=("gather", "varlen", "flex", "triton"),
    kernel_repeats=20,
    check_kernels=("triton",),
    decode_attention="triton",
    bench_batch_sizes=(1, 8, 32),
    bench_new_tokens=64,
    bench_repeats=3,
    profile_batch=8,
    profile_new_tokens=8,
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
    # triton: in Triton's interpreter, float32 (scripts/gpu_check.py turns it on for --smoke).
    kernel_backends=("gather", "varlen-emulated", "varlen", "triton"),
    kernel_repeats=2,
    check_kernels=("triton",),
    decode_attention="triton",
    bench_batch_sizes=(2,),
    bench_new_tokens=3,
    bench_repeats=1,
    profile_batch=2,
    profile_new_tokens=3,
)
