"""The continuous-batching engine: the step loop that serves requests to the end.

The lifecycle of a request is the article's: tokenize (done by the caller) -> allocate prompt
blocks -> prefill -> sample -> append -> decode loop -> release. Per engine step:
1. the scheduler (``harness.runtime.scheduler``) chooses every running request's tokens;
   each gets every group's table and its tokens' slots in one manager call, ``append``
   (a decode token, a token and its drafts, or a chunk), made by ``Scheduler.grow``
   called from the loop (a decode step reaches the block pool in 5 frames below
   ``run``); when the pool is dry it hands back the most recently admitted and the engine
   preempts it (``harness.runtime.preemption``: by recompute, or by swap to the host tier
   with ``preemption="swap"``), so no victim sits in the step's forward; the transfers the
   appends ask for (copy-on-write copies) are made in the store before any preemption, a
   victim's at its preemption;
2. waiting requests are admitted first-come-first-served while their prompt's blocks can
   be allocated (``allocate`` gives the slots of what the first forward feeds: a prefix
   hit's ``cached_tokens`` are not fed again), a swapped one by ``swap_in`` and its one
   ``append`` (it resumes where it stopped); then one ``take_transfers``, made in the
   store in the manager's order (all device -> host, copy-on-write, all host -> device,
   then the blocks windows freed), then the forward;
3. one packed forward (``[1, T]``, prefills and decodes mixed; ``step_batch``) writes the
   new K/V to the store at those slots and reads each request's K/V through its tables
   (the store takes each request's ``AppendedSlots`` whole);
4. each request takes its tokens from the step's logits, copied to the host once (greedy
   is one ``argmax(dim=-1)`` over the step); drafts are verified and the rejected rolled
   back; ``n > 1`` continuations fork after the prefill; a finished request releases;
   the usage sample reads ``usage`` once.

So a decode step of N running requests makes N + 2 manager calls: N ``append``, one
``take_transfers``, one ``usage`` (``tests/harness/test_engine_calls.py``); a step that
releases a finished request makes its transfers once more after the releases.

The engine decides *when* a request receives blocks; the manager decides *which*; the
store (``harness.runtime.kv_store``) holds the tensors. The engine is store-agnostic, so
the allocator gate runs this same loop on contiguous buffers and compares.
"""

import time
from collections import deque
from typing import Any, ClassVar

import torch

from harness.models import model_kv_layout
from harness.runtime.attention_backends import GATHER, AttentionBackend
from harness.runtime.events import PoolEvent, PoolEventKind, PoolObserver, ignore_pool_events
from harness.runtime.host_tier import HostTierSteps
from harness.runtime.kv_store import KVStore
from harness.runtime.paged_attention import forward_step, using_paged_attention
from harness.runtime.preemption import PreemptMode
from harness.runtime.requests import (
    Request,
    RequestOutput,
    RunningRequest,
    continuation_id,
    new_child,
    new_running,
)
from harness.runtime.results import EngineResult, SpeculationCounts, UsageSample, usage_sample
from harness.runtime.sampling import continuation_first_tokens, logits_to_host, sample_token
from harness.runtime.scheduler import NO_SCHEDULING, Scheduler, Scheduling
from harness.runtime.speculation import accepted_tokens
from harness.runtime.state_mixer import using_paged_state
from harness.runtime.step_batch import StepMetadata, pack_step
from harness.state_models import checkpoint_interval_of
from impl import AppendedSlots, KVCacheManager
from spec.kinds import kind_names


class Engine:
    """Runs requests over one ``KVCacheManager`` and one ``KVStore`` until all finish.

    ``scheduler_type`` chooses each step's tokens and admissions (a subclass may plant a
    different scheduler); ``observer`` hears of every step, fork, preemption, swap and
    release. ``prefix_caching`` gives the manager token ids (off: counts, nothing cached);
    ``preemption`` is how a victim gives its blocks back (``PreemptMode``).
    """

    scheduler_type: ClassVar[type[Scheduler]] = Scheduler

    def __init__(
        self,
        model: Any,  # Any: a transformers causal LM
        manager: KVCacheManager,
        store: KVStore,
        eos_token_id: int | None,
        *,
        prefix_caching: bool = True,
        observer: PoolObserver = ignore_pool_events,
        scheduling: Scheduling = NO_SCHEDULING,
        attention: AttentionBackend = GATHER,
        preemption: PreemptMode = "recompute",
    ) -> None:
        # Refuses what the hook cannot run; a hybrid's state group checkpoints every C.
        model_groups = model_kv_layout(
            model, checkpoint_interval_of(manager.group_windows)
        ).group_windows
        self.attention = attention
        if manager.group_windows != model_groups:
            raise ValueError(
                f"the manager's group_windows {kind_names(manager.group_windows)} are not the "
                f"model's KV cache groups {kind_names(model_groups)} "
                "(harness.runtime.kv_pool.new_manager)"
            )
        self.model = model
        self.manager = manager
        self.store = store
        self.eos_token_id = eos_token_id
        self.observer = observer
        self.host_tier = HostTierSteps(manager, store, preemption)
        self.scheduler = self.scheduler_type(manager, scheduling, prefix_caching=prefix_caching)
        self._speculation = SpeculationCounts()
        self._device: torch.device = next(model.parameters()).device
        self._prefill_tokens = 0
        self._step = 0

    @property
    def step(self) -> int:
        """The engine step under way (the last one, once ``run`` has returned)."""
        return self._step

    def run(self, requests: list[Request]) -> EngineResult:
        """Serve ``requests`` (arrival order by ``arrival_step``, then list order) to the end."""
        scheduler = self.scheduler
        scheduler.check_fit(requests)
        ordered = sorted(requests, key=lambda request: request.arrival_step)
        waiting = deque(new_running(request) for request in ordered)
        running: list[RunningRequest] = []
        outputs: dict[str, RequestOutput] = {}
        schedule: list[tuple[str, ...]] = []
        usage: list[UsageSample] = []
        counters_before = self.manager.usage()
        self._prefill_tokens = 0
        self._speculation = SpeculationCounts()
        self.host_tier.start_run()
        step = 0
        started = time.perf_counter()
        try:
            with torch.no_grad(), using_paged_attention(self.model), using_paged_state(self.model):
                while waiting or running:
                    if not running and waiting[0].request.arrival_step > step:
                        step = waiting[0].request.arrival_step  # nothing to do until then
                    self._step = step
                    # Every scheduled request's slots, one append each; a dry pool's victims
                    # preempted as they come (the scheduler picks them, the engine acts).
                    grown: dict[str, AppendedSlots] = {}
                    scheduled = scheduler.schedule(running)
                    while (victim := scheduler.grow(running, scheduled, grown)) is not None:
                        self._preempt(victim, waiting)
                    while waiting and waiting[0].request.arrival_step <= step:
                        budget = scheduler.budget_left(running, grown)
                        appended = self._admit(waiting[0], budget) if budget >= 1 else None
                        if appended is None:
                            break
                        admitted = waiting.popleft()
                        outputs[admitted.request.request_id] = admitted.output
                        running.append(admitted)
                        grown[admitted.request.request_id] = appended
                    self._transfer()  # copy-on-write, swap-ins', host hits', windows' skips
                    groups = self._forward_groups(
                        [r for r in running if r.request.request_id in grown]
                    )
                    schedule.extend(tuple(r.request.request_id for r in g) for g in groups)
                    step_logits = [self._forward(group, grown) for group in groups]
                    children = self._take_tokens(
                        [r for group in groups for r in group], logits_to_host(step_logits)
                    )
                    for child in children:
                        outputs[child.request.request_id] = child.output
                    running.extend(children)
                    usage.append(usage_sample(self.manager.usage()))
                    self._notify("step")
                    finished = [r for r in running if r.is_finished(self.eos_token_id)]
                    for done in finished:
                        running.remove(done)
                        self._release(done)
                    if finished:
                        # A release may leave copies pending (the host prefix cache copies
                        # freed cached blocks out): made now, so those blocks are free for
                        # the next step's admissions.
                        self._transfer()
                    step += 1
        finally:
            # An exception mid-run must not leak blocks: whoever is still running lets go.
            for leftover in running + [r for r in waiting if r.swapped]:
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
            host=self.host_tier.end_run(),
        )

    # -- the step ------------------------------------------------------------------------

    def _forward_groups(self, running: list[RunningRequest]) -> list[list[RunningRequest]]:
        """Which running requests share a forward: all of them, packed in one."""
        return [running] if running else []

    # -- lifecycle -----------------------------------------------------------------------

    def _admit(self, waiting: RunningRequest, budget: int) -> AppendedSlots | None:
        """The scheduler's admission of ``waiting`` (a swapped-out one's resumption timed
        and counted): the slots of what it feeds this step, or ``None``."""
        if not waiting.swapped:
            return self.scheduler.admit(waiting, budget)
        started = time.perf_counter()
        appended = self.scheduler.admit(waiting, budget)
        self.host_tier.resumed(appended is not None, time.perf_counter() - started)
        if appended is not None:
            self._notify("swap_in", waiting.request.request_id)
        return appended

    def _transfer(self) -> None:
        """Every transfer the manager has pending, made in the store in its order."""
        self.host_tier.transfer(self.manager.take_transfers())

    def _forward(
        self, group: list[RunningRequest], grown: dict[str, AppendedSlots]
    ) -> torch.Tensor:
        """One forward of ``group``: float32 logits ``[rows, vocab]`` on the device, each
        request's ``logit_rows`` in turn (a decode's one per fed token, a prefill's last
        chunk one, an earlier chunk none)."""
        steps = [grown[running.request.request_id] for running in group]
        for running, step in zip(group, steps, strict=True):
            running.output.max_blocks = max(running.output.max_blocks, len(step.block_ids[0]))
        plan = self.store.plan(steps)
        tables = [step.table() for step in steps]  # group 0's, for the kernel and the packing
        kernel = self.attention.prepare(self.store, tables, plan)  # once per step, all layers
        packed = pack_step(group, tables, self._device)
        return forward_step(
            self.model,
            packed.input_ids,
            packed.positions,
            StepMetadata(self.store, plan, packed.slices, kernel),
            packed.logit_rows,
        )

    def _take_tokens(
        self, rows: list[RunningRequest], logits: torch.Tensor
    ) -> list[RunningRequest]:
        """Each of the step's requests takes its tokens; returns the children forks made.

        ``logits``: ``[rows, vocab]`` float32 on the host, each request's ``logit_rows``
        in the order of ``rows``. Greedy tokens come from one ``argmax(dim=-1)`` over the
        step; each emitted token keeps its row (a view) for the checks. An earlier prefill
        chunk emits nothing; a decode with drafts emits one to ``1 + drafts`` tokens.
        """
        greedy = logits.argmax(dim=-1).tolist()
        children: list[RunningRequest] = []
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

    def _chunk_done(self, running: RunningRequest) -> None:
        """A prefill chunk's K/V are in the pool now (some again, after a recompute)."""
        running.output.prefill_chunks += 1
        self._prefill_tokens += len(running.pending_ids)
        end = running.computed + len(running.pending_ids)
        self.host_tier.recomputed(running.computed, end, running.dropped)
        running.computed = end

    def _emit(self, running: RunningRequest, logits: torch.Tensor, greedy: int) -> None:
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

    def _verify(self, running: RunningRequest, logits: torch.Tensor, greedy: list[int]) -> None:
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
            self._roll_back(running)

    def _roll_back(self, running: RunningRequest) -> None:
        """Truncate the request to its ``computed`` tokens (the rejected drafts' K/V go).

        The store hears of the blocks that became free and uncached and of the rolled-back
        slots of a kept last block only this request holds (``stale_slots``, every group's):
        a poisoned pool fills both with NaN, so a stale read of a rejected draft's K/V
        shows. A kept block another request also holds (a prefix hit on a block the drafts
        filled) keeps its K/V.
        """
        request_id = running.request.request_id
        released = self.manager.truncate(request_id, running.computed)
        stale = [slot for group_slots in released.stale_slots for slot in group_slots]
        self.store.truncate(request_id, list(released.freed_block_ids), stale)

    def _fork(self, parent: RunningRequest, logits: torch.Tensor) -> list[RunningRequest]:
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
            children.append(new_child(parent, child_id, first_tokens[rank], logits))
        return children

    def _release(self, running: RunningRequest) -> None:
        request_id = running.request.request_id
        released = self.manager.release(request_id)
        # Only blocks nobody may read again: a block another table holds keeps valid K/V,
        # and so does a cached free block (a later prefix hit takes it back as it is). A
        # block the host prefix cache copies out waits in flight for the next transfers.
        self.store.release(request_id, list(released.freed_block_ids))
        self._notify("release", request_id)

    def _preempt(self, victim: RunningRequest, waiting: deque[RunningRequest]) -> None:
        """Preempt ``victim`` (``Scheduler.grow``'s, when the pool is dry) and put it back
        at the head of ``waiting``.

        NOTE: the transfers the step's appends asked for (copy-on-write copies) are made in
        the store first: the victim's release may free a copy's source block, which a
        poisoned pool would fill with NaN before the copy.
        """
        self._transfer()
        swapped = self.host_tier.preempt(victim)
        self._notify("swap_out" if swapped else "preempt", victim.request.request_id)
        waiting.appendleft(victim)

    def _notify(self, kind: PoolEventKind, *request_ids: str) -> None:
        self.observer(PoolEvent(kind, self._step, request_ids), self.manager)


class BatchInvariantEngine(Engine):
    """The same engine, but every request runs its own forward (M = 1 per decode).

    Requests still share the pool and interleave in it; only the matrix products stop
    mixing rows of different requests, so each request computes exactly what it would
    alone and continuous batching matches ``generate`` bit for bit (but for a partial
    prefill after a prefix hit or a preemption, which computes the same values by a
    different SDPA path). Forwards run in admission order, so a request that hits a
    prefix block another admitted in the same step fills reads it after it is written.
    """

    def _forward_groups(self, running: list[RunningRequest]) -> list[list[RunningRequest]]:
        return [[one] for one in running]
