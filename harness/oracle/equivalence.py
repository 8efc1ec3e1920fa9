"""One equivalence run: dense ``generate``, paged alone, paged batched, contiguous batched.

For a list of requests it runs
- the dense reference, ``generate`` one request at a time (checks 2 and 3 compare to it);
  a request with several continuations gets one ``generate`` per continuation, its first
  token forced (``generate_dense_continuation``);
- each request alone (with its continuations, each in its own forward) through the paged
  engine, on a fresh manager over the same pool (check 2), so the pool is full of an
  earlier request's stale K/V;
- all requests with continuous batching on the paged pool (check 3), with the configured
  prefix caching on or off;
- the allocator gate (check 1): the batched schedule without prefix caching on the paged
  pool and on contiguous per-request buffers (contiguous buffers have no K/V for a prefix
  hit; with prefix caching off the batched run is the gate's paged run);
and gathers a row per continuation and the run's totals. It is *not* the command line.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from harness.kv_events import KVEventLog
from harness.kv_layout import KVLayout
from harness.models import LoadedModel, kv_layout
from harness.oracle.checks import (
    CheckResult,
    TieRule,
    TokenTrace,
    check_alone,
    check_batch,
    check_gate,
    max_logprob_delta,
    tie_rule,
)
from harness.oracle.dense import DenseOutput, generate_dense, generate_dense_continuation
from harness.runtime.attention_backends import (
    GATHER,
    AttentionBackend,
    LayerAgreement,
    PagedKernel,
)
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.events import PoolObserver, ignore_pool_events
from harness.runtime.kv_pool import PagedKVPool, new_manager
from harness.runtime.kv_store import KVStore
from harness.runtime.preemption import PreemptMode
from harness.runtime.requests import Request, RequestOutput
from harness.runtime.results import EngineResult, HostTierCounts, SpeculationCounts, UsageSample
from harness.runtime.scheduler import NO_SCHEDULING, Scheduling
from harness.runtime.sdpa_order import harness_sdpa_order
from harness.state_models import default_interval

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The paged pool to run on, the engine and pool classes, and how prompts get blocks.

    ``observer`` watches the pool during the continuous-batching run (check 3) only, and
    ``kv_events`` records that run's KV cache events (``harness.kv_events``).
    ``scheduling`` (speculation, a token budget) applies to the continuous-batching runs
    (check 3 and both sides of the gate), not to the requests run alone (check 2): a
    verify forward or a prefill chunk has other shapes than ``generate``'s, so it cannot be
    bitwise equal to it.
    ``attention`` computes the batched run (check 3) and both sides of the gate; check 2
    stays on gather, its bitwise comparison with ``generate`` being gather's promise.
    ``preemption``, ``host_blocks`` and ``host_prefix_cache`` (the host tier) apply to the
    continuous-batching runs too: both sides of the gate swap alike, the contiguous side
    keeping a swapped request's buffer where the paged side moves its blocks.
    """

    total_blocks: int
    block_size: int
    engine_type: type[Engine] = Engine
    pool_type: type[PagedKVPool] = PagedKVPool
    prefix_caching: bool = True
    observer: PoolObserver | None = None
    kv_events: KVEventLog | None = None
    scheduling: Scheduling = NO_SCHEDULING
    attention: AttentionBackend = GATHER
    preemption: PreemptMode = "recompute"
    host_blocks: int = 0
    host_prefix_cache: bool = False


def tight_total_blocks(
    requests: Sequence[Request], block_size: int, group_count: int = 1, state_groups: int = 0
) -> int:
    """The main job's pool: about a quarter of what all requests need at once (so blocks
    are freed and reused, and requests are preempted), but at least the largest one; with
    ``group_count`` attention KV cache groups each may need its blocks once per group, and
    ``state_groups`` state groups two blocks each (``Request.blocks_needed``)."""
    needs = [request.blocks_needed(block_size, group_count, state_groups) for request in requests]
    return max(*needs, -(-sum(needs) // 4))


@dataclass(frozen=True, slots=True)
class RequestReport:
    """One request's (or continuation's) row: sizes, the three checks, drift, blocks held."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    gate: CheckResult
    alone: CheckResult
    batch: CheckResult
    max_logprob_delta: float
    max_blocks: int
    prefill_chunks: int = 0
    cache_salt: str | None = None  # its tenant's salt (None: no salt)
    prefix_hit_tokens: int = 0  # prompt tokens its admissions in the batched run found cached

    @property
    def passed(self) -> bool:
        """All three checks passed."""
        return self.gate.passed and self.alone.passed and self.batch.passed


@dataclass(frozen=True, slots=True)
class EquivalenceReport:
    """Every request's row and the run's totals; ``usage``: the batched run's pool per step."""

    rows: list[RequestReport]
    dense_tokens_per_s: float
    paged_tokens_per_s: float
    pool_bytes: int
    peak_paged_bytes: int
    contiguous_bytes: int
    block_utilization: float
    peak_requests: int
    tie_rule: TieRule
    schedules_equal: bool
    attention: str
    prefill_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    preemptions: int
    blocks_saved_by_sharing: int
    model_name: str
    pool: PoolConfig
    blocks_freed_by_window: int = 0
    peak_blocks_saved_by_window: int = 0
    usage: list[UsageSample] = field(default_factory=list)
    speculation: SpeculationCounts = field(default_factory=SpeculationCounts)
    host: HostTierCounts = field(default_factory=HostTierCounts)  # the batched run's
    batched_s: float = 0.0  # the continuous-batching run's wall time
    chunks_per_prompt: float = 1.0  # prefill forwards per request (a recompute's included)
    # per layer, max |kernel - gather| over the batched run's attention outputs (empty
    # for gather)
    attention_agreement: dict[int, float] = field(default_factory=dict)
    # a hybrid's: the state group's checkpoint interval (0: no state group) and the bytes
    # of the paged pool's state rows, beside the K/V's pool_bytes
    checkpoint_interval: int = 0
    state_bytes: int = 0

    @property
    def prefix_hit_tokens_by_salt(self) -> dict[str, int]:
        """The batched run's prefix hit tokens per cache salt, over the salted rows."""
        totals: dict[str, int] = {}
        for row in self.rows:
            if row.cache_salt is not None:
                totals[row.cache_salt] = totals.get(row.cache_salt, 0) + row.prefix_hit_tokens
        return totals

    @property
    def passed(self) -> bool:
        """Every request passed every check."""
        return self.schedules_equal and all(row.passed for row in self.rows)

    @property
    def failures(self) -> list[str]:
        """One line per failed check of a request (its step, tokens and margin), and one if
        the paged and contiguous runs were scheduled differently; empty when all passed."""
        lines = [
            f"{name}: {check.detail}"
            for row in self.rows
            for name, check in (("gate", row.gate), ("alone", row.alone), ("batch", row.batch))
            if not check.passed
        ]
        if not self.schedules_equal:
            lines.append("gate: the paged and contiguous runs were scheduled differently")
        return lines

    def summary(self) -> str:
        """The verdict in a few lines: the failures and near-ties, the count passing, PASS or
        FAIL (the main command prints it under its table)."""
        ties = [row.batch.detail for row in self.rows if row.batch.tie]
        passing = sum(1 for row in self.rows if row.passed)
        return "\n".join(
            [
                *(f"  {line}" for line in self.failures),
                *(f"  batch: {detail}" for detail in ties),
                f"requests and continuations passing all three checks: {passing}/"
                f"{len(self.rows)} (ties: {len(ties)}; tie rule: {self.tie_rule.describe()})",
                f"paged and contiguous schedules identical: {self.schedules_equal}",
                "RESULT: PASS" if self.passed else "RESULT: FAIL",
            ]
        )


def run_equivalence(
    loaded: LoadedModel, requests: list[Request], pool: PoolConfig, progress: Progress
) -> EquivalenceReport:
    """Run all four generations of ``requests`` and check them against each other (a
    hybrid's state checkpointed every ``pool.scheduling.checkpoint_interval`` tokens, the
    default for the block size when 0); on CUDA with SDPA's cuDNN backend last
    (``harness.runtime.sdpa_order``)."""
    with harness_sdpa_order(next(loaded.model.parameters()).device):
        return _run_generations(loaded, requests, pool, progress)


def _run_generations(
    loaded: LoadedModel, requests: list[Request], pool: PoolConfig, progress: Progress
) -> EquivalenceReport:
    interval = pool.scheduling.checkpoint_interval or default_interval(pool.block_size)
    layout = kv_layout(loaded, interval)
    eos = loaded.eos_token_id
    dense: dict[str, DenseOutput] = {}
    for number, request in enumerate(requests, 1):
        progress(f"dense generate: request {number}/{len(requests)}")
        dense.update(_generate_dense(loaded, request))

    paged_pool = pool.pool_type(layout, pool.total_blocks, pool.block_size, pool.host_blocks)
    alone: dict[str, RequestOutput] = {}
    for number, request in enumerate(requests, 1):
        progress(f"paged, one request alone: request {number}/{len(requests)}")
        manager = new_manager(layout, pool.total_blocks, pool.block_size)
        # Its continuations each in their own forward (M = 1), like generate's.
        engine = BatchInvariantEngine(
            loaded.model, manager, paged_pool, eos, prefix_caching=pool.prefix_caching
        )
        alone.update(engine.run([replace(request, arrival_step=0)]).outputs)

    def run_packed(
        store: KVStore,
        prefix_caching: bool,
        observer: PoolObserver = ignore_pool_events,
        attention: AttentionBackend = pool.attention,
        kv_events: KVEventLog | None = None,
    ) -> EngineResult:
        """All requests through ``pool.engine_type`` on a fresh manager and ``store``."""
        manager = new_manager(
            layout,
            pool.total_blocks,
            pool.block_size,
            event_sink=None if kv_events is None else kv_events.record,
            host_event_sink=None if kv_events is None else kv_events.host_sink,
            host_blocks=pool.host_blocks,
            host_prefix_cache=pool.host_prefix_cache,
        )
        engine = pool.engine_type(
            loaded.model,
            manager,
            store,
            eos,
            prefix_caching=prefix_caching,
            observer=observer,
            scheduling=pool.scheduling,
            attention=attention,
            preemption=pool.preemption,
        )
        if kv_events is not None:
            kv_events.step_of = lambda: engine.step
        return engine.run(requests)

    progress(f"paged, continuous batching ({pool.attention.name}): {len(requests)} requests")
    agreement = LayerAgreement()
    batched = run_packed(
        paged_pool,
        pool.prefix_caching,
        pool.observer or ignore_pool_events,  # the CLI gives None without --pool-map
        measured(pool.attention, agreement),
        pool.kv_events,
    )
    gate_paged = batched
    if pool.prefix_caching:
        progress(f"paged, same batching without prefix caching (gate): {len(requests)} requests")
        gate_paged = run_packed(paged_pool, prefix_caching=False)
    progress(f"contiguous buffers, same schedule (gate): {len(requests)} requests")
    max_tokens = max(request.max_tokens for request in requests)
    contiguous = run_packed(
        ContiguousKVBuffers(layout, max_tokens, pool.block_size), prefix_caching=False
    )
    report = _report(
        requests,
        dense=dense,
        alone=alone,
        batched=batched,
        gate=(gate_paged, contiguous),
        layout=layout,
        pool=pool,
        model_name=loaded.name,
    )
    return replace(
        report,
        attention_agreement=agreement.max_abs_diff,
        checkpoint_interval=layout.checkpoint_interval,
        state_bytes=paged_pool.states.nbytes,
    )


def measured(attention: AttentionBackend, agreement: LayerAgreement) -> AttentionBackend:
    """``attention`` folding its per-layer agreement with gather into ``agreement`` (a kernel
    backend; gather is returned as it is, it has nothing to agree with)."""
    if isinstance(attention, PagedKernel):
        return replace(attention, agreement=agreement)
    return attention


def _generate_dense(loaded: LoadedModel, request: Request) -> dict[str, DenseOutput]:
    """The dense reference of every continuation of ``request``, by sequence id."""
    model, eos = loaded.model, loaded.eos_token_id
    if request.num_continuations == 1:
        return {
            request.request_id: generate_dense(
                model, request.prompt_ids, request.max_new_tokens, eos
            )
        }
    return {
        sequence_id: generate_dense_continuation(
            model,
            request.prompt_ids,
            request.max_new_tokens,
            eos,
            rank=rank,
            num_continuations=request.num_continuations,
        )
        for rank, sequence_id in enumerate(request.sequence_ids)
    }


def _trace(output: RequestOutput | DenseOutput) -> TokenTrace:
    return TokenTrace(output.token_ids, output.logits)


def _report(
    requests: list[Request],
    *,
    dense: dict[str, DenseOutput],
    alone: dict[str, RequestOutput],
    batched: EngineResult,
    gate: tuple[EngineResult, EngineResult],
    layout: KVLayout,
    pool: PoolConfig,
    model_name: str,
) -> EquivalenceReport:
    rule = tie_rule(layout.dtype)
    gate_paged, contiguous = gate
    rows = []
    for request in requests:
        for sequence_id in request.sequence_ids:
            paged = batched.outputs[sequence_id]
            reference = _trace(dense[sequence_id])
            gate_check = check_gate(
                sequence_id,
                _trace(gate_paged.outputs[sequence_id]),
                _trace(contiguous.outputs[sequence_id]),
            )
            rows.append(
                RequestReport(
                    request_id=sequence_id,
                    prompt_tokens=len(request.prompt_ids),
                    generated_tokens=len(paged.token_ids),
                    gate=gate_check,
                    alone=check_alone(sequence_id, _trace(alone[sequence_id]), reference),
                    batch=check_batch(sequence_id, _trace(paged), reference, rule),
                    max_logprob_delta=max_logprob_delta(_trace(paged), reference),
                    max_blocks=paged.max_blocks,
                    prefill_chunks=paged.prefill_chunks,
                    cache_salt=request.cache_salt,
                    prefix_hit_tokens=paged.prefix_hit_tokens,
                )
            )
    dense_tokens = sum(len(output.token_ids) for output in dense.values())
    dense_seconds = sum(output.elapsed_s for output in dense.values())
    bytes_per_block = pool.block_size * layout.bytes_per_block_token
    max_tokens = max(request.max_tokens for request in requests)
    return EquivalenceReport(
        rows=rows,
        dense_tokens_per_s=dense_tokens / dense_seconds,
        paged_tokens_per_s=batched.generated_tokens / batched.elapsed_s,
        pool_bytes=pool.total_blocks * bytes_per_block,
        peak_paged_bytes=batched.peak_used_blocks * bytes_per_block,
        contiguous_bytes=batched.peak_requests * max_tokens * layout.bytes_per_token,
        block_utilization=batched.block_utilization,
        peak_requests=batched.peak_requests,
        tie_rule=rule,
        schedules_equal=gate_paged.schedule == contiguous.schedule,
        attention=pool.attention.name,
        prefill_tokens=batched.prefill_tokens,
        prefix_hit_tokens=batched.prefix_hit_tokens,
        cow_copies=batched.cow_copies,
        preemptions=batched.preemptions,
        blocks_saved_by_sharing=batched.blocks_saved_by_sharing,
        model_name=model_name,
        pool=pool,
        blocks_freed_by_window=batched.blocks_freed_by_window,
        peak_blocks_saved_by_window=batched.peak_blocks_saved_by_window,
        usage=batched.usage,
        speculation=batched.speculation,
        host=batched.host,
        batched_s=batched.elapsed_s,
        chunks_per_prompt=sum(batched.outputs[r.request_id].prefill_chunks for r in requests)
        / len(requests),
    )
