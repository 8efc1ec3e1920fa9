"""One equivalence run: dense ``generate``, paged alone, paged batched, contiguous batched.

For a list of requests it runs
- the dense reference, ``generate`` one request at a time (checks 2 and 3 compare to it);
- each request alone through the paged engine, on a fresh manager over the same pool
  (check 2), so the pool is full of an earlier request's stale K/V;
- all requests with continuous batching on the paged pool (check 3);
- the same batched schedule on contiguous per-request buffers (check 1, the gate);
and gathers a row per request and the run's totals. It is *not* the command line.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.dense import DenseOutput, generate_dense
from harness.engine import Engine, EngineResult, Request, RequestOutput
from harness.kv_pool import ContiguousKVBuffers, KVLayout, PagedKVPool
from harness.models import LoadedModel
from harness.oracle import (
    TIE_MARGINS,
    CheckResult,
    TokenTrace,
    check_batched,
    check_bitwise,
    check_gate,
    max_logprob_delta,
)
from impl import KVBlockManager

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The paged pool to run on, and the engine and pool classes to run with."""

    num_blocks: int
    block_size: int
    engine_type: type[Engine] = Engine
    pool_type: type[PagedKVPool] = PagedKVPool


@dataclass(frozen=True, slots=True)
class RequestReport:
    """One request's row: sizes, the three checks, the logprob drift, blocks held."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    gate: CheckResult
    bitwise: CheckResult
    batched: CheckResult
    max_logprob_delta: float
    max_blocks: int

    @property
    def passed(self) -> bool:
        """All three checks passed."""
        return self.gate.passed and self.bitwise.passed and self.batched.passed


@dataclass(frozen=True, slots=True)
class EquivalenceReport:
    """Every request's row and the run's totals."""

    rows: list[RequestReport]
    dense_tokens_per_s: float
    paged_tokens_per_s: float
    pool_bytes: int
    peak_paged_bytes: int
    contiguous_bytes: int
    block_utilization: float
    peak_requests: int
    tie_margin: float
    schedules_equal: bool

    @property
    def passed(self) -> bool:
        """Every request passed every check."""
        return self.schedules_equal and all(row.passed for row in self.rows)


def kv_layout(loaded: LoadedModel) -> KVLayout:
    """The K/V shape of ``loaded``'s model, on its device and dtype."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(loaded.model.parameters())
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=parameter.dtype,
        device=parameter.device,
    )


def run_equivalence(
    loaded: LoadedModel, requests: list[Request], pool: PoolConfig, progress: Progress
) -> EquivalenceReport:
    """Run all four generations of ``requests`` and check them against each other."""
    layout = kv_layout(loaded)
    eos = loaded.eos_token_id
    dense: dict[str, DenseOutput] = {}
    for number, request in enumerate(requests, 1):
        progress(f"dense generate: request {number}/{len(requests)}")
        dense[request.request_id] = generate_dense(
            loaded.model, request.prompt_ids, request.max_new_tokens, eos
        )

    paged_pool = pool.pool_type(layout, pool.num_blocks, pool.block_size)
    alone: dict[str, RequestOutput] = {}
    for number, request in enumerate(requests, 1):
        progress(f"paged, one request alone: request {number}/{len(requests)}")
        manager = KVBlockManager(pool.num_blocks, pool.block_size)
        engine = Engine(loaded.model, manager, paged_pool, eos)
        alone.update(engine.run([_arriving_now(request)]).outputs)

    progress(f"paged, continuous batching: {len(requests)} requests")
    batched = pool.engine_type(
        loaded.model, KVBlockManager(pool.num_blocks, pool.block_size), paged_pool, eos
    ).run(requests)
    progress(f"contiguous buffers, same schedule: {len(requests)} requests")
    max_tokens = max(request.max_tokens for request in requests)
    contiguous = pool.engine_type(
        loaded.model,
        KVBlockManager(pool.num_blocks, pool.block_size),
        ContiguousKVBuffers(layout, max_tokens),
        eos,
    ).run(requests)
    return _report(
        requests,
        dense=dense,
        alone=alone,
        batched=batched,
        contiguous=contiguous,
        layout=layout,
        pool=pool,
    )


def _arriving_now(request: Request) -> Request:
    return Request(request.request_id, request.prompt_ids, request.max_new_tokens, 0)


def _trace(output: RequestOutput | DenseOutput) -> TokenTrace:
    return TokenTrace(output.token_ids, output.logits)


def _report(
    requests: list[Request],
    *,
    dense: dict[str, DenseOutput],
    alone: dict[str, RequestOutput],
    batched: EngineResult,
    contiguous: EngineResult,
    layout: KVLayout,
    pool: PoolConfig,
) -> EquivalenceReport:
    tie_margin = TIE_MARGINS.get(layout.dtype, TIE_MARGINS[torch.float32])
    rows = []
    for request in requests:
        request_id = request.request_id
        paged = batched.outputs[request_id]
        reference = _trace(dense[request_id])
        rows.append(
            RequestReport(
                request_id=request_id,
                prompt_tokens=len(request.prompt_ids),
                generated_tokens=len(paged.token_ids),
                gate=check_gate(request_id, _trace(paged), _trace(contiguous.outputs[request_id])),
                bitwise=check_bitwise(request_id, _trace(alone[request_id]), reference),
                batched=check_batched(request_id, _trace(paged), reference, tie_margin),
                max_logprob_delta=max_logprob_delta(_trace(paged), reference),
                max_blocks=paged.max_blocks,
            )
        )
    dense_tokens = sum(len(output.token_ids) for output in dense.values())
    dense_seconds = sum(output.elapsed_s for output in dense.values())
    bytes_per_block = pool.block_size * layout.bytes_per_token
    max_tokens = max(request.max_tokens for request in requests)
    return EquivalenceReport(
        rows=rows,
        dense_tokens_per_s=dense_tokens / dense_seconds,
        paged_tokens_per_s=batched.generated_tokens / batched.elapsed_s,
        pool_bytes=pool.num_blocks * bytes_per_block,
        peak_paged_bytes=batched.peak_used_blocks * bytes_per_block,
        contiguous_bytes=batched.peak_requests * max_tokens * layout.bytes_per_token,
        block_utilization=batched.block_utilization,
        peak_requests=batched.peak_requests,
        tie_margin=tie_margin,
        schedules_equal=batched.schedule == contiguous.schedule,
    )
