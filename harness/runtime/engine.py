"""The continuous-batching engine: requests arrive, get blocks, prefill, decode together, release.

The lifecycle of a request is the article's: tokenize (done by the caller) -> allocate prompt
blocks -> prefill -> sample -> append -> decode loop -> release. Per engine step:
1. every running request that decodes gets its new token's slot (``append_token_slot``,
   or ``append_slot`` without prefix caching); when the pool is dry the most recently
   admitted request is preempted (released, and requeued at the head of the waiting queue
   to be recomputed), so no victim ever sits in the step's forward. A copy-on-write copy
   an append asks for is made in the store at once (see ``_grow``);
2. waiting requests are admitted first-come-first-served while their prompt's blocks can
   be allocated: ``allocate_prompt`` (prefix caching: ``cached_tokens`` of the prompt
   already have K/V in the pool and are not fed again) or ``allocate`` by count;
3. one packed forward (``[1, T]``, prefills and decodes mixed) writes the new K/V to the
   store at those slots and reads each request's K/V through its block table;
4. each request takes one token from the step's logits, copied to the host once (one
   transfer, one sync per step; greedy is one ``argmax(dim=-1)`` over the step); a
   request with ``num_continuations = n > 1`` forks ``n - 1`` children after its prefill,
   each starting from another of the prefill's best tokens; a finished request releases
   its blocks at once.

The engine decides *when* a request receives blocks; the manager decides *which*; the
store (``harness.runtime.kv_pool``) holds the tensors. The engine is store-agnostic, so the
allocator gate runs this same loop on contiguous buffers and compares.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from harness.models import model_kv_layout
from harness.runtime.attention_backends import GATHER, AttentionBackend
from harness.runtime.kv_pool import KVStore
from harness.runtime.paged_attention import (
    RequestSlice,
    StepMetadata,
    forward_step,
    partial_prefill_mask,
    using_paged_attention,
)
from harness.runtime.speculation import accepted_tokens, propose_drafts
from impl import KVBlockManager, RequestBlockTable
from spec import BlockAllocationError, blocks_for_tokens, slot_index


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature and top-p with a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Scheduling:
    """What one engine step may feed beyond a whole prompt or one token per request.

    ``speculate = k >= 1``: each greedy decode verifies up to ``k`` prompt-lookup drafts
    in its forward (``harness.runtime.speculation``); sampled requests never speculate.
    ``max_batch_tokens = N``: at most ``N`` tokens per step, decodes (and their drafts)
    first, then prefill chunks; ``None``: no budget, every prompt in one forward.
    """

    speculate: int = 0
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 drafts, got {self.speculate}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


NO_SCHEDULING = Scheduling()


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt (token ids) to extend by up to ``max_new_tokens``, arriving at ``arrival_step``.

    ``num_continuations = n > 1`` asks for ``n`` greedy continuations with distinct first
    tokens (``continuation_first_tokens``); continuation ``k > 0`` is reported under
    ``continuation_id(request_id, k)``.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY
    num_continuations: int = 1

    @property
    def max_tokens(self) -> int:
        """The most tokens this request can hold: prompt plus every new token."""
        return len(self.prompt_ids) + self.max_new_tokens

    def blocks_needed(self, block_size: int) -> int:
        """The most blocks all its continuations hold at once, alone in a pool.

        They share the prompt's full blocks; each needs the rest of its own up to
        ``max_tokens`` (a copy of a shared partly filled block included).
        """
        shared = len(self.prompt_ids) // block_size
        own = blocks_for_tokens(block_size, self.max_tokens) - shared
        return shared + self.num_continuations * own

    @property
    def sequence_ids(self) -> list[str]:
        """The ids its continuations are reported under: its own, then the children's."""
        return [continuation_id(self.request_id, k) for k in range(self.num_continuations)]


def continuation_id(request_id: str, rank: int) -> str:
    """Continuation ``rank`` of a request: rank 0 is the request itself, then ``"{id}/{k}"``."""
    return request_id if rank == 0 else f"{request_id}/{rank}"


def continuation_first_tokens(logits: torch.Tensor, count: int) -> list[int]:
    """The first tokens of ``count`` continuations from one ``[vocab]`` row of logits.

    The argmax first (what greedy decoding picks), then the next best tokens in
    ``torch.topk``'s order, skipping the argmax should a tie put it elsewhere.
    """
    best = int(torch.argmax(logits))
    ranked = [int(i) for i in torch.topk(logits, count).indices if int(i) != best]
    return [best, *ranked[: count - 1]]


@dataclass(slots=True)
class RequestOutput:
    """What a request produced: tokens, the float32 logits each was chosen from, blocks held."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # each [vocab] float32, host
    max_blocks: int = 0
    prefill_chunks: int = 0  # forwards that fed its prompt (a recompute's included)


@dataclass(frozen=True, slots=True)
class UsageSample:
    """The pool after one step: blocks in use, tokens held/reserved, blocks named by tables.

    ``table_blocks`` counts a block once per table that holds it, so it exceeds
    ``used_blocks`` by exactly the blocks sharing saves at that step. ``cached_free_blocks``
    are free blocks still holding a cached prefix; ``preemptions`` counts the manager's
    preemptions so far (the steps where it grows are the steps that preempted).
    ``skipped_table_blocks`` counts the blocks sliding windows released from the running
    requests' tables, over all groups (once per table, like ``table_blocks``): what
    keeping every block would hold on top of ``used_blocks``.
    """

    used_blocks: int
    request_count: int
    allocated_tokens: int
    reserved_tokens: int
    table_blocks: int
    cached_free_blocks: int = 0
    preemptions: int = 0
    skipped_table_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """A moment an observer of the pool is told of: the end of a step (after the forward,
    before finished requests release), or a preemption, fork or release just done.

    ``request_ids``: none for a step, the parent then the child for a fork, else the one.
    """

    kind: Literal["step", "preempt", "fork", "release"]
    step: int
    request_ids: tuple[str, ...] = ()


# Called with each event and the manager after it; it must only read the manager.
PoolObserver = Callable[[PoolEvent, KVBlockManager], None]


@dataclass(slots=True)
class SpeculationCounts:
    """Drafts proposed and accepted, and the tokens decodes emitted per decode forward.

    A decode forward is one request's part of one step's forward (its pending token, plus
    its drafts when it speculates); without speculation each emits exactly one token.
    """

    proposed_drafts: int = 0
    accepted_drafts: int = 0
    decode_forwards: int = 0
    decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0.0 when none was proposed)."""
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per decode forward (1.0 without speculation)."""
        return self.decode_tokens / self.decode_forwards if self.decode_forwards else 0.0


@dataclass(slots=True)
class EngineResult:
    """A whole run: per-request outputs, which requests shared each forward, and pool usage.

    ``prefill_tokens`` counts the prompt tokens fed to forwards (a prefix hit's cached
    tokens are not; a preempted request's recompute is); the last four count what the
    manager counted over the run (``blocks_freed_by_window``: table entries sliding
    windows released).
    """

    outputs: dict[str, RequestOutput]
    schedule: list[tuple[str, ...]]
    usage: list[UsageSample]
    elapsed_s: float
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    preemptions: int = 0
    speculation: SpeculationCounts = field(default_factory=SpeculationCounts)
    blocks_freed_by_window: int = 0

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
        """Tokens held / token slots reserved, summed over all steps (1.0 = no waste).

        Tokens are counted per table, slots per block in use: with shared blocks (prefix
        hits, forks) it can exceed 1.
        """
        reserved = sum(sample.reserved_tokens for sample in self.usage)
        allocated = sum(sample.allocated_tokens for sample in self.usage)
        return allocated / reserved if reserved else 1.0

    @property
    def blocks_saved_by_sharing(self) -> int:
        """The most, after any step, by which the blocks all tables name exceed those in use."""
        return max((s.table_blocks - s.used_blocks for s in self.usage), default=0)

    @property
    def peak_blocks_saved_by_window(self) -> int:
        """The most blocks, after any step, that keeping every block would have held on
        top of those in use: the running tables' entries sliding windows released."""
        return max((s.skipped_table_blocks for s in self.usage), default=0)


class Allocation(Protocol):
    """How the engine asks the manager for a request's blocks: with token ids or by count."""

    def allocate(self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]) -> int:
        """Allocate the prompt ``token_ids``; returns how many of them are cached already."""
        ...

    def append(self, manager: KVBlockManager, request_id: str, token_id: int) -> int:
        """Append ``token_id`` (whose K/V the next forward computes); returns its slot."""
        ...

    def cached_tokens(self, manager: KVBlockManager, token_ids: tuple[int, ...]) -> int:
        """How many tokens of the prompt ``token_ids`` ``allocate`` would find cached."""
        ...

    def extend(
        self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]
    ) -> RequestBlockTable:
        """Append several tokens in one operation (a prefill chunk, a token and its drafts)."""
        ...


class PrefixCaching:
    """Prompts through ``allocate_prompt`` (cached full blocks are reused), decode tokens
    through ``append_token_slot`` (a block is cached when it fills)."""

    __slots__ = ()

    def allocate(self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]) -> int:
        """The prompt's blocks, reusing the longest cached prefix."""
        return manager.allocate_prompt(request_id, token_ids).cached_tokens

    def append(self, manager: KVBlockManager, request_id: str, token_id: int) -> int:
        """One token's slot; caches the block it fills."""
        return manager.append_token_slot(request_id, token_id)

    def cached_tokens(self, manager: KVBlockManager, token_ids: tuple[int, ...]) -> int:
        """The longest cached prefix of the whole prompt, in tokens."""
        return manager.cached_prefix_tokens(token_ids)

    def extend(
        self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]
    ) -> RequestBlockTable:
        """The tokens' slots; caches every block they fill."""
        return manager.append_token_ids(request_id, token_ids)


class NoPrefixCaching:
    """Prompts through ``allocate`` by count, decode tokens through ``append_slot``."""

    __slots__ = ()

    def allocate(self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]) -> int:
        """Fresh blocks for the whole prompt: nothing is cached."""
        manager.allocate(request_id, len(token_ids))
        return 0

    def append(self, manager: KVBlockManager, request_id: str, token_id: int) -> int:
        """One token's slot."""
        return manager.append_slot(request_id)

    def cached_tokens(self, manager: KVBlockManager, token_ids: tuple[int, ...]) -> int:
        """Nothing is cached."""
        return 0

    def extend(
        self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]
    ) -> RequestBlockTable:
        """The tokens' slots, by count."""
        return manager.append_tokens(request_id, len(token_ids))


PREFIX_CACHING = PrefixCaching()
NO_PREFIX_CACHING = NoPrefixCaching()


@dataclass(slots=True)
class _Running:
    request: Request  # a child continuation's is its parent's with the child's id and n = 1
    output: RequestOutput
    generator: torch.Generator | None
    pending_ids: list[int]  # tokens whose K/V the next forward computes (a chunk, or a
    # decode's token and its drafts)
    prefill: bool = True  # it is feeding the tokens of its (re)admission, chunk by chunk
    prefill_ids: tuple[int, ...] = ()  # the tokens its (re)admission prefills
    computed: int = 0  # tokens of its table whose K/V are in the pool

    @property
    def last_chunk(self) -> bool:
        """Whether its pending tokens end its prefill (the forward then samples a token)."""
        return self.computed + len(self.pending_ids) == len(self.prefill_ids)

    @property
    def logit_rows(self) -> int:
        """How many of its pending tokens' logits the next forward keeps."""
        if self.prefill:
            return 1 if self.last_chunk else 0
        return len(self.pending_ids)


class Engine:
    """Runs requests over one ``KVBlockManager`` and one ``KVStore`` until all finish."""

    def __init__(
        self,
        model: Any,  # Any: a transformers causal LM
        manager: KVBlockManager,
        store: KVStore,
        eos_token_id: int | None,
        allocation: Allocation = PREFIX_CACHING,
        *,
        observer: PoolObserver | None = None,
        scheduling: Scheduling = NO_SCHEDULING,
        attention: AttentionBackend = GATHER,
    ) -> None:
        model_groups = model_kv_layout(model).group_windows  # refuses what the hook cannot run
        self.attention = attention
        if manager.group_windows != model_groups:
            raise ValueError(
                f"the manager's group_windows {manager.group_windows} are not the model's KV "
                f"cache groups {model_groups} (harness.runtime.kv_pool.new_manager)"
            )
        self.model = model
        self.manager = manager
        self.store = store
        self.eos_token_id = eos_token_id
        self.allocation = allocation
        self.observer = observer
        self.scheduling = scheduling
        self._speculation = SpeculationCounts()
        self._device: torch.device = next(model.parameters()).device
        self._prefill_tokens = 0
        self._step = 0

    def run(self, requests: list[Request]) -> EngineResult:
        """Serve ``requests`` (arrival order by ``arrival_step``, then list order) to the end."""
        self._check_fit(requests)
        ordered = sorted(requests, key=lambda request: request.arrival_step)
        waiting = deque(self._new_running(request) for request in ordered)
        running: list[_Running] = []
        outputs: dict[str, RequestOutput] = {}
        schedule: list[tuple[str, ...]] = []
        usage: list[UsageSample] = []
        counters_before = self.manager.usage()
        self._prefill_tokens = 0
        self._speculation = SpeculationCounts()
        step = 0
        started = time.perf_counter()
        try:
            with torch.no_grad(), using_paged_attention(self.model):
                while waiting or running:
                    if not running and waiting[0].request.arrival_step > step:
                        step = waiting[0].request.arrival_step  # nothing to do until then
                    self._step = step
                    grown = self._grow_decoding(running, waiting, self._schedule(running))
                    while waiting and waiting[0].request.arrival_step <= step:
                        budget = self._budget_left(running, grown)
                        if budget < 1 or not self._admit(waiting[0], budget):
                            break
                        admitted = waiting.popleft()
                        outputs[admitted.request.request_id] = admitted.output
                        running.append(admitted)
                        grown[admitted.request.request_id] = self._grow(admitted)
                    self._release_out_of_window()
                    groups = self._forward_groups(
                        [r for r in running if r.request.request_id in grown]
                    )
                    schedule.extend(tuple(r.request.request_id for r in g) for g in groups)
                    step_logits = [self._forward(group, grown) for group in groups]
                    children = self._take_tokens(
                        [r for group in groups for r in group], _to_host(step_logits)
                    )
                    for child in children:
                        outputs[child.request.request_id] = child.output
                    running.extend(children)
                    usage.append(self._usage_sample())
                    self._notify("step")
                    for finished in [r for r in running if self._is_finished(r)]:
                        running.remove(finished)
                        self._release(finished)
                    step += 1
        finally:
            # An exception mid-run must not leak blocks: whoever is still running lets go.
            for leftover in running:
                self._release(leftover)
        counters = self.manager.usage()
        return EngineResult(
            outputs,
            schedule,
            usage,
            time.perf_counter() - started,
            prefill_tokens=self._prefill_tokens,
            prefix_hit_tokens=counters.prefix_hit_tokens - counters_before.prefix_hit_tokens,
            cow_copies=counters.cow_copies - counters_before.cow_copies,
            preemptions=counters.preemptions - counters_before.preemptions,
            speculation=self._speculation,
            blocks_freed_by_window=counters.skipped_blocks - counters_before.skipped_blocks,
        )

    # -- scheduling ----------------------------------------------------------------------

    def _check_fit(self, requests: list[Request]) -> None:
        """Refuse, before anything runs, a request whose continuations alone outgrow the pool."""
        block_size = self.manager.block_size
        for request in requests:
            if request.num_continuations < 1:
                raise ValueError(
                    f"request {request.request_id!r} asks for {request.num_continuations} "
                    "continuations; at least 1"
                )
            if request.num_continuations > 1 and request.sampling.temperature > 0:
                raise ValueError(
                    f"request {request.request_id!r}: several continuations are greedy with "
                    "distinct first tokens; sampling is not supported with them"
                )
            # Each KV cache group holds the whole prompt's blocks until a decode skips
            # some: with several groups a request may need its blocks once per group.
            needed = request.blocks_needed(block_size) * len(self.manager.group_windows)
            if needed > self.manager.total_blocks:
                raise ValueError(
                    f"request {request.request_id!r} needs up to {needed} blocks "
                    f"({request.max_tokens} tokens, {request.num_continuations} continuations) "
                    f"but the pool has {self.manager.total_blocks}"
                )

    def _admit(self, waiting: _Running, budget: int) -> bool:
        """Allocate the blocks of ``waiting``'s prompt, or of its first chunk of at most
        ``budget`` tokens, if the pool has them now.

        The prefix hit is over the whole prompt, so a chunk never feeds cached tokens:
        ``allocate(prompt[:hit + chunk])`` finds the same hit (it never covers the last
        token of what it is given, and the chunk has at least one).

        NOTE: no headroom is kept back for running requests: when a decode append later
        finds the pool dry, the most recently admitted request is preempted and recomputed.
        A refused allocation changes nothing in the manager.
        """
        request = waiting.request
        # A preempted request comes back with its generated tokens as part of its prompt.
        token_ids = request.prompt_ids + tuple(waiting.output.token_ids)
        hit = self.allocation.cached_tokens(self.manager, token_ids)
        end = min(len(token_ids), hit + budget)
        try:
            cached_tokens = self.allocation.allocate(
                self.manager, request.request_id, token_ids[:end]
            )
        except BlockAllocationError:
            return False
        # Our own bug if it fails: the cut prompt must hit exactly the whole prompt's blocks.
        assert cached_tokens == hit, f"hit {cached_tokens} of a chunk, {hit} of the prompt"
        waiting.prefill_ids = token_ids
        waiting.computed = hit
        waiting.pending_ids = list(token_ids[hit:end])
        waiting.prefill = True
        return True

    def _schedule(self, running: list[_Running]) -> list[_Running]:
        """Choose every running request's tokens for this step (its ``pending_ids``);
        returns those that feed any, in running order.

        Decodes first (each its token and up to ``speculate`` drafts), then the next chunk
        of each unfinished prefill, while ``max_batch_tokens`` lasts; a request left
        without budget waits for the next step.
        """
        budget = self._budget()
        chosen: set[str] = set()
        for current in running:
            if not current.prefill and budget >= 1:
                token_id = current.output.token_ids[-1]
                current.pending_ids = [token_id, *self._drafts(current, budget - 1)]
                budget -= len(current.pending_ids)
                chosen.add(current.request.request_id)
        for current in running:
            if current.prefill and budget >= 1:
                current.pending_ids = self._next_chunk(current, budget)
                budget -= len(current.pending_ids)
                chosen.add(current.request.request_id)
        return [r for r in running if r.request.request_id in chosen]

    def _budget(self) -> int:
        """The step's token budget (without one: more than any step can feed)."""
        limit = self.scheduling.max_batch_tokens
        return limit if limit is not None else 1 << 62

    def _budget_left(
        self, running: list[_Running], grown: dict[str, tuple[list[int], RequestBlockTable]]
    ) -> int:
        """What the step's budget has left after the tokens already scheduled."""
        fed = sum(len(r.pending_ids) for r in running if r.request.request_id in grown)
        return self._budget() - fed

    def _drafts(self, running: _Running, budget: int) -> list[int]:
        """Prompt-lookup drafts for a decode (see ``_draft_count``)."""
        count = self._draft_count(running, budget)
        if count < 1:
            return []
        output = running.output
        return propose_drafts(running.request.prompt_ids + tuple(output.token_ids), count)

    def _draft_count(self, running: _Running, budget: int) -> int:
        """How many drafts a decode may verify: at most ``speculate`` and ``budget``, one
        fewer than the tokens it may still emit (the verify adds its own token), and none
        for a sampled request (acceptance here is greedy's)."""
        if running.generator is not None:
            return 0
        room = running.request.max_new_tokens - len(running.output.token_ids) - 1
        return min(self.scheduling.speculate, budget, room)

    def _next_chunk(self, running: _Running, budget: int) -> list[int]:
        """The next at most ``budget`` tokens of an unfinished prefill."""
        start = running.computed
        return list(running.prefill_ids[start : start + budget])

    def _grow_decoding(
        self, running: list[_Running], waiting: deque[_Running], scheduled: list[_Running]
    ) -> dict[str, tuple[list[int], RequestBlockTable]]:
        """Give every ``scheduled`` request the slots of its tokens (a decode's token and
        drafts, a prefill's next chunk), preempting when the pool is dry.

        The victim is the most recently admitted request (the end of ``running``): it has
        not appended yet this step, or it is the request whose append failed. Victims go
        back to the head of ``waiting`` in admission order.
        """
        grown: dict[str, tuple[list[int], RequestBlockTable]] = {}
        scheduled_ids = {r.request.request_id for r in scheduled}
        index = 0
        while index < len(running):
            current = running[index]
            if current.request.request_id not in scheduled_ids:
                index += 1
                continue
            try:
                grown[current.request.request_id] = self._grow(current)
            except BlockAllocationError:
                victim = running.pop()
                self._preempt(victim)
                waiting.appendleft(victim)
                if victim is current:
                    break
                continue  # the same request tries again with the victim's blocks
            index += 1
        return grown

    def _forward_groups(self, running: list[_Running]) -> list[list[_Running]]:
        """Which running requests share a forward: all of them, packed in one."""
        return [running] if running else []

    def _is_finished(self, running: _Running) -> bool:
        token_ids = running.output.token_ids
        if not token_ids:
            return False  # still prefilling
        if len(token_ids) >= running.request.max_new_tokens:
            return True
        return self.eos_token_id is not None and token_ids[-1] == self.eos_token_id

    # -- lifecycle -----------------------------------------------------------------------

    def _new_running(self, request: Request) -> _Running:
        generator = None
        if request.sampling.temperature > 0:
            # On the host, where the logits are sampled: the same draws on every device.
            generator = torch.Generator()
            generator.manual_seed(request.sampling.seed)
        return _Running(
            request=request,
            output=RequestOutput(request.request_id, len(request.prompt_ids)),
            generator=generator,
            pending_ids=[],
        )

    def _grow(self, running: _Running) -> tuple[list[int], RequestBlockTable]:
        """The slots of the tokens this forward feeds (a prefill chunk, one appended token,
        or a token and its drafts) and the request's table after them.

        A later chunk, or a token with drafts, is added in one operation (``extend``):
        everything one forward computes is one allocator step. An admission's first chunk
        was allocated by ``_admit``.

        NOTE: a copy-on-write copy the append asks for is made in the store right here,
        not just before the forward: a victim preempted later in this step may release the
        copy's source block, which a poisoned pool would fill with NaN before the copy.
        """
        manager = self.manager
        request_id = running.request.request_id
        if not running.prefill and len(running.pending_ids) == 1:
            (token_id,) = running.pending_ids
            new_slots = [self.allocation.append(manager, request_id, token_id)]
            self._copy_pending_blocks()
            return new_slots, manager.snapshot_request(request_id)
        table = manager.snapshot_request(request_id)
        if table.token_count == running.computed:
            table = self.allocation.extend(manager, request_id, tuple(running.pending_ids))
            self._copy_pending_blocks()
        first_new = table.token_count - len(running.pending_ids)
        first = table.skipped_blocks * manager.block_size  # blocks a prefix hit left skipped
        new_slots = [
            slot_index(manager.block_size, table.block_ids, position - first)
            for position in range(first_new, table.token_count)
        ]
        return new_slots, table

    def _copy_pending_blocks(self) -> None:
        copies = self.manager.take_copies()
        if copies:
            self.store.copy_blocks(copies)

    def _forward(
        self, group: list[_Running], grown: dict[str, tuple[list[int], RequestBlockTable]]
    ) -> torch.Tensor:
        """One forward of ``group``: float32 logits ``[rows, vocab]`` on the device, each
        request's ``logit_rows`` in turn (a decode's one per fed token, a prefill's last
        chunk one, an earlier chunk none)."""
        device = self._device
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[RequestSlice] = []
        tables: list[RequestBlockTable] = []
        new_slots: list[list[int]] = []
        for running in group:
            slots, table = grown[running.request.request_id]
            tables.append(table)
            new_slots.append(slots)
            start = len(input_ids)
            input_ids.extend(running.pending_ids)
            new_tokens = len(running.pending_ids)
            positions.extend(range(table.token_count - new_tokens, table.token_count))
            mask = partial_prefill_mask(new_tokens, table.token_count, device)
            slices.append(RequestSlice(start, len(input_ids), mask))
            running.output.max_blocks = max(running.output.max_blocks, len(table.block_ids))
        self._copy_pending_blocks()  # none left by _grow; kept for any other caller
        # Each request's table in KV cache groups 1.. (sliding windows), as grown.
        group_tables = [
            [self.manager.snapshot_request(table.request_id, group) for table in tables]
            for group in range(1, len(self.manager.group_windows))
        ]
        plan = self.store.plan(tables, new_slots, group_tables)
        kernel = self.attention.prepare(self.store, tables, plan)  # once per step, all layers
        return forward_step(
            self.model,
            torch.tensor([input_ids], dtype=torch.int64, device=device),
            torch.tensor([positions], dtype=torch.int64, device=device),
            StepMetadata(self.store, plan, tuple(slices), kernel),
            torch.tensor(
                [
                    row
                    for running, part in zip(group, slices, strict=True)
                    for row in range(part.query_end - running.logit_rows, part.query_end)
                ],
                dtype=torch.int64,
                device=device,
            ),
        )

    def _take_tokens(self, rows: list[_Running], logits: torch.Tensor) -> list[_Running]:
        """Each of the step's requests takes its tokens; returns the children forks made.

        ``logits``: ``[rows, vocab]`` float32 on the host, each request's ``logit_rows``
        in the order of ``rows``. Greedy tokens come from one ``argmax(dim=-1)`` over the
        step; each emitted token keeps its row (a view) for the checks. An earlier prefill
        chunk emits nothing; a decode with drafts emits one to ``1 + drafts`` tokens.
        """
        greedy = logits.argmax(dim=-1).tolist()
        children: list[_Running] = []
        row = 0
        for running in rows:
            count = running.logit_rows
            rows_logits, rows_greedy = logits[row : row + count], greedy[row : row + count]
            row += count
            if running.prefill:
                self._chunk_done(running)
                if count == 0:
                    continue  # an earlier chunk: the prompt is not over
                first = not running.output.token_ids
                self._emit(running, rows_logits[0], rows_greedy[0])
                running.prefill = False
                if first and running.request.num_continuations > 1:
                    children.extend(self._fork(running, rows_logits[0]))
            elif count == 1:
                running.computed += 1
                self._emit(running, rows_logits[0], rows_greedy[0])
                self._speculation.decode_forwards += 1
                self._speculation.decode_tokens += 1
            else:
                self._verify(running, rows_logits, rows_greedy)
        return children

    def _chunk_done(self, running: _Running) -> None:
        """A prefill chunk's K/V are in the pool now."""
        running.output.prefill_chunks += 1
        self._prefill_tokens += len(running.pending_ids)
        running.computed += len(running.pending_ids)

    def _emit(self, running: _Running, logits: torch.Tensor, greedy: int) -> None:
        """Append one token, greedy or sampled from ``logits`` ``[vocab]``, with its row."""
        generator = running.generator
        token_id = (
            greedy
            if generator is None
            else sample_token(logits, running.request.sampling, generator)
        )
        running.output.token_ids.append(token_id)
        running.output.logits.append(logits)
        running.pending_ids = [token_id]

    def _verify(self, running: _Running, logits: torch.Tensor, greedy: list[int]) -> None:
        """Keep the drafts greedy decoding agrees with, and its token after them; roll the
        rest back.

        ``logits``: ``[1 + drafts, vocab]``, row ``i`` the choice after the pending token
        and ``drafts[:i]``. The tokens stop at ``max_new_tokens`` and after an eos, as
        one-token decoding would. The pending token and the kept drafts keep their K/V;
        the last emitted token is the next pending one.
        """
        drafts = running.pending_ids[1:]
        emitted = accepted_tokens(drafts, greedy)
        counts = self._speculation
        counts.proposed_drafts += len(drafts)
        counts.accepted_drafts += len(emitted) - 1
        emitted = emitted[: running.request.max_new_tokens - len(running.output.token_ids)]
        if self.eos_token_id in emitted:
            emitted = emitted[: emitted.index(self.eos_token_id) + 1]
        for index, token_id in enumerate(emitted):
            self._emit(running, logits[index], token_id)
        counts.decode_forwards += 1
        counts.decode_tokens += len(emitted)
        fed_end = running.computed + len(drafts) + 1
        running.computed += len(emitted)
        if running.computed < fed_end:
            self._roll_back(running, fed_end)

    def _roll_back(self, running: _Running, fed_end: int) -> None:
        """Truncate the request to its ``computed`` tokens (the rejected drafts' K/V go).

        The store hears of the blocks that became free and uncached and of the rolled-back
        slots of a kept last block only this request holds: a poisoned pool fills both
        with NaN, so a stale read of a rejected draft's K/V shows. A kept block another
        request also holds (a prefix hit on a block the drafts filled) keeps its K/V.
        """
        manager = self.manager
        request_id = running.request.request_id
        keep = running.computed
        released = manager.truncate_blocks(request_id, keep)
        block_size = manager.block_size
        slots: list[int] = []
        for group in range(len(manager.group_windows)):  # each KV cache group's last block
            table = manager.snapshot_request(request_id, group)
            block_ids, skipped = table.block_ids, table.skipped_blocks
            if keep % block_size and manager.ref_count(block_ids[-1]) == 1:
                end = min(fed_end, (skipped + len(block_ids)) * block_size)
                slots += [slot_index(block_size, block_ids, p, skipped) for p in range(keep, end)]
        self.store.truncate(request_id, list(released.freed_block_ids), slots)

    def _fork(self, parent: _Running, logits: torch.Tensor) -> list[_Running]:
        """Fork the parent's ``n - 1`` children right after its first token was sampled.

        ``logits``: ``[vocab]``, the prefill's. Child ``k`` shares every block of the parent
        (the prompt) and starts from the ``k``-th of ``continuation_first_tokens``.
        """
        request = parent.request
        first_tokens = continuation_first_tokens(logits, request.num_continuations)
        # The parent chose by argmax too; a mismatch would be our own bug.
        assert first_tokens[0] == parent.output.token_ids[0], "parent is not continuation 0"
        children = []
        for rank in range(1, request.num_continuations):
            child_id = continuation_id(request.request_id, rank)
            self.manager.fork(request.request_id, child_id)
            self.store.fork(request.request_id, child_id)
            self._notify("fork", request.request_id, child_id)
            token_id = first_tokens[rank]
            output = RequestOutput(
                child_id,
                len(request.prompt_ids),
                [token_id],
                [logits],
                parent.output.max_blocks,
                parent.output.prefill_chunks,
            )
            children.append(
                _Running(
                    request=replace(request, request_id=child_id, num_continuations=1),
                    output=output,
                    generator=None,
                    pending_ids=[token_id],
                    prefill=False,
                    computed=parent.computed,
                )
            )
        return children

    def _release(self, running: _Running) -> None:
        request_id = running.request.request_id
        released = self.manager.release_blocks(request_id)
        # Only blocks nobody may read again: a block another table holds keeps valid K/V,
        # and so does a cached free block (a later prefix hit revives it as it is).
        self.store.release(request_id, list(released.freed_block_ids))
        self._notify("release", request_id)

    def _release_out_of_window(self) -> None:
        """Hand the store the blocks sliding windows made free this step (the step's
        appends and prompt allocations skipped them), before the forward: a poisoned pool
        fills them at once, so a forward reading one shows."""
        skipped = self.manager.take_skipped_blocks()
        if skipped:
            self.store.release_out_of_window(skipped)

    def _preempt(self, running: _Running) -> None:
        request_id = running.request.request_id
        released = self.manager.preempt(request_id)
        self.store.release(request_id, list(released.freed_block_ids))
        self._notify("preempt", request_id)

    def _notify(
        self, kind: Literal["step", "preempt", "fork", "release"], *request_ids: str
    ) -> None:
        if self.observer is not None:
            self.observer(PoolEvent(kind, self._step, request_ids), self.manager)

    def _usage_sample(self) -> UsageSample:
        usage = self.manager.usage()
        table_blocks = sum(len(table.block_ids) for table in self.manager.request_tables.values())
        skipped = 0
        for group in range(1, len(self.manager.group_windows)):
            for request_id in self.manager.request_tables:
                table = self.manager.snapshot_request(request_id, group)
                table_blocks += len(table.block_ids)
                skipped += table.skipped_blocks
        skipped += sum(table.skipped_blocks for table in self.manager.request_tables.values())
        # NOTE: the cached free queue is copied to count it (O(cached free blocks)), like the
        # tables above; the manager has no O(1) count of it.
        return UsageSample(
            usage.used_blocks,
            usage.request_count,
            usage.allocated_tokens,
            usage.reserved_tokens,
            table_blocks,
            cached_free_blocks=len(self.manager.cached_free_block_ids),
            preemptions=usage.preemptions,
            skipped_table_blocks=skipped,
        )


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """A token drawn from ``logits`` ([vocab], host) by temperature and top-p."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _to_host(step_logits: list[torch.Tensor]) -> torch.Tensor:
    """The step's logits, every forward's rows in order, ``[rows, vocab]`` on the host.

    NOTE: the step's one device-to-host transfer and its one sync: greedy choice, sampling
    and the checks all read the host copy, so the device holds no logits between steps
    (one float32 row is 192 KiB for SmolLM2's 49,152-token vocabulary).
    """
    stacked = step_logits[0] if len(step_logits) == 1 else torch.cat(step_logits)
    return stacked.cpu()


class BatchInvariantEngine(Engine):
    """The same engine, but every request runs its own forward (M = 1 per decode).

    Requests still share the pool and interleave in it; only the matrix products stop
    mixing rows of different requests, so each request computes exactly what it would
    alone and continuous batching matches ``generate`` bit for bit (but for a partial
    prefill after a prefix hit or a preemption, which computes the same values by a
    different SDPA path). Forwards run in admission order, so a request that hits a
    prefix block another admitted in the same step fills reads it after it is written.
    """

    def _forward_groups(self, running: list[_Running]) -> list[list[_Running]]:
        return [[one] for one in running]
