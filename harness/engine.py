"""The continuous-batching engine: requests arrive, get blocks, prefill, decode together, release.

The lifecycle of a request is the article's: tokenize (done by the caller) -> allocate prompt
blocks -> prefill -> sample -> append -> decode loop -> release. Per engine step:
1. admit waiting requests first-come-first-served while the pool can take them (see
   ``_fits``); each gets ``manager.allocate(request_id, prompt_tokens)``;
2. every running request gets one new token's slot from ``manager.append_slot``;
3. one packed forward (``[1, T]``, prefills and decodes mixed) writes the new K/V to the
   store at those slots and reads each request's K/V through its block table;
4. each request samples one token; a finished one releases its blocks at once, so a
   waiting request can take them in the next step.

The engine decides *when* a request receives blocks; the manager decides *which*; the
store (``harness.kv_pool``) holds the tensors. The engine is store-agnostic, so the
allocator gate runs this same loop on contiguous buffers and compares.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.kv_pool import KVStore
from harness.paged_attention import RequestSlice, StepMetadata, forward_step, using_paged_attention
from impl import KVBlockManager, RequestBlockTable
from spec import blocks_for_tokens, slot_index


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature and top-p with a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt (token ids) to extend by up to ``max_new_tokens``, arriving at ``arrival_step``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY

    @property
    def max_tokens(self) -> int:
        """The most tokens this request can hold: prompt plus every new token."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(slots=True)
class RequestOutput:
    """What a request produced: tokens, the float32 logits each was chosen from, blocks held."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # each [vocab] float32
    max_blocks: int = 0


@dataclass(frozen=True, slots=True)
class UsageSample:
    """The pool after one step's appends: blocks in use and tokens held/reserved in them."""

    used_blocks: int
    request_count: int
    allocated_tokens: int
    reserved_tokens: int


@dataclass(slots=True)
class EngineResult:
    """A whole run: per-request outputs, which requests shared each forward, and pool usage."""

    outputs: dict[str, RequestOutput]
    schedule: list[tuple[str, ...]]
    usage: list[UsageSample]
    elapsed_s: float

    @property
    def generated_tokens(self) -> int:
        """All tokens sampled in the run."""
        return sum(len(output.token_ids) for output in self.outputs.values())

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks in use after any step."""
        return max((sample.used_blocks for sample in self.usage), default=0)

    @property
    def peak_requests(self) -> int:
        """The most requests holding blocks after any step."""
        return max((sample.request_count for sample in self.usage), default=0)

    @property
    def block_utilization(self) -> float:
        """Tokens held / token slots reserved, summed over all steps (1.0 = no waste)."""
        reserved = sum(sample.reserved_tokens for sample in self.usage)
        allocated = sum(sample.allocated_tokens for sample in self.usage)
        return allocated / reserved if reserved else 1.0


@dataclass(slots=True)
class _Running:
    request: Request
    output: RequestOutput
    generator: torch.Generator | None
    pending_ids: list[int]  # tokens to feed in the next forward (the prompt, then one token)


class Engine:
    """Runs requests over one ``KVBlockManager`` and one ``KVStore`` until all finish."""

    def __init__(
        self,
        model: Any,  # Any: a transformers causal LM
        manager: KVBlockManager,
        store: KVStore,
        eos_token_id: int | None,
    ) -> None:
        self.model = model
        self.manager = manager
        self.store = store
        self.eos_token_id = eos_token_id
        self._device: torch.device = next(model.parameters()).device

    def run(self, requests: list[Request]) -> EngineResult:
        """Serve ``requests`` (arrival order by ``arrival_step``, then list order) to the end."""
        self._check_fit(requests)
        waiting = deque(sorted(requests, key=lambda request: request.arrival_step))
        running: list[_Running] = []
        outputs: dict[str, RequestOutput] = {}
        schedule: list[tuple[str, ...]] = []
        usage: list[UsageSample] = []
        step = 0
        started = time.perf_counter()
        try:
            with torch.no_grad(), using_paged_attention(self.model):
                while waiting or running:
                    if not running and waiting[0].arrival_step > step:
                        step = waiting[0].arrival_step  # nothing to do until the next arrival
                    while (
                        waiting
                        and waiting[0].arrival_step <= step
                        and self._fits(waiting[0], running)
                    ):
                        admitted = self._admit(waiting.popleft())
                        outputs[admitted.request.request_id] = admitted.output
                        running.append(admitted)
                    for group in self._forward_groups(running):
                        schedule.append(tuple(r.request.request_id for r in group))
                        self._forward(group)
                    usage.append(self._usage_sample())
                    for finished in [r for r in running if self._is_finished(r)]:
                        running.remove(finished)
                        self._release(finished)
                    step += 1
        finally:
            # An exception mid-run must not leak blocks: whoever is still running lets go.
            for leftover in running:
                self._release(leftover)
        return EngineResult(outputs, schedule, usage, time.perf_counter() - started)

    # -- scheduling ----------------------------------------------------------------------

    def _check_fit(self, requests: list[Request]) -> None:
        for request in requests:
            needed = blocks_for_tokens(self.manager.block_size, request.max_tokens)
            if needed > self.manager.total_blocks:
                raise ValueError(
                    f"request {request.request_id!r} needs up to {needed} blocks "
                    f"({request.max_tokens} tokens) but the pool has {self.manager.total_blocks}"
                )

    def _fits(self, request: Request, running: list[_Running]) -> bool:
        """Whether ``request`` can be admitted now without ever starving a running one.

        NOTE: there is no preemption, so admission keeps back the blocks each running
        request may still take (up to its ``max_tokens``); blocks are still taken one at a
        time by ``append_slot``, when a token actually needs them.
        """
        block_size = self.manager.block_size
        owed = 0
        for other in running:
            table = self.manager.snapshot_request(other.request.request_id)
            owed += blocks_for_tokens(block_size, other.request.max_tokens) - len(table.block_ids)
        needed = blocks_for_tokens(block_size, request.max_tokens)
        return self.manager.num_free_blocks - owed >= needed

    def _forward_groups(self, running: list[_Running]) -> list[list[_Running]]:
        """Which running requests share a forward: all of them, packed in one."""
        return [running] if running else []

    def _is_finished(self, running: _Running) -> bool:
        token_ids = running.output.token_ids
        if len(token_ids) >= running.request.max_new_tokens:
            return True
        return self.eos_token_id is not None and token_ids[-1] == self.eos_token_id

    # -- lifecycle -----------------------------------------------------------------------

    def _admit(self, request: Request) -> _Running:
        generator = None
        if request.sampling.temperature > 0:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(request.sampling.seed)
        self.manager.allocate(request.request_id, len(request.prompt_ids))
        return _Running(
            request=request,
            output=RequestOutput(request.request_id, len(request.prompt_ids)),
            generator=generator,
            pending_ids=list(request.prompt_ids),
        )

    def _grow(self, running: _Running) -> tuple[list[int], RequestBlockTable]:
        """The slots of the tokens this forward feeds (the prompt's, or one appended token's)
        and the request's table after them."""
        manager = self.manager
        request_id = running.request.request_id
        if running.output.token_ids:
            new_slots = [manager.append_slot(request_id)]
            return new_slots, manager.snapshot_request(request_id)
        table = manager.snapshot_request(request_id)
        new_slots = [
            slot_index(manager.block_size, table.block_ids, position)
            for position in range(table.token_count)
        ]
        return new_slots, table

    def _forward(self, group: list[_Running]) -> None:
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[RequestSlice] = []
        for running in group:
            new_slots, table = self._grow(running)
            plan = self.store.plan(table.request_id, table.block_ids, table.token_count, new_slots)
            start = len(input_ids)
            input_ids.extend(running.pending_ids)
            positions.extend(range(table.token_count - len(running.pending_ids), table.token_count))
            slices.append(RequestSlice(plan, start, len(input_ids)))
            running.output.max_blocks = max(running.output.max_blocks, len(table.block_ids))
        device = self._device
        logits = forward_step(
            self.model,
            torch.tensor([input_ids], dtype=torch.int64, device=device),
            torch.tensor([positions], dtype=torch.int64, device=device),
            StepMetadata(self.store, tuple(slices)),
            torch.tensor([s.query_end - 1 for s in slices], dtype=torch.int64, device=device),
        )
        for row, running in enumerate(group):
            token_id = self._sample(logits[row], running)
            running.output.token_ids.append(token_id)
            running.output.logits.append(logits[row])
            running.pending_ids = [token_id]

    def _sample(self, logits: torch.Tensor, running: _Running) -> int:
        sampling = running.request.sampling
        if running.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=running.generator))

    def _release(self, running: _Running) -> None:
        request_id = running.request.request_id
        block_ids = self.manager.release(request_id)
        self.store.release(request_id, block_ids)

    def _usage_sample(self) -> UsageSample:
        usage = self.manager.usage()
        return UsageSample(
            usage.used_blocks, usage.request_count, usage.allocated_tokens, usage.reserved_tokens
        )


class BatchInvariantEngine(Engine):
    """The same engine, but every request runs its own forward (M = 1 per decode).

    Requests still share the pool and interleave in it; only the matrix products stop
    mixing rows of different requests, so each request computes exactly what it would
    alone and continuous batching matches ``generate`` bit for bit.
    """

    def _forward_groups(self, running: list[_Running]) -> list[list[_Running]]:
        return [[one] for one in running]
