"""What each engine step feeds: admission, the token budget, prefill chunks and drafts,
and the one manager call that gives a request its tokens' slots.

The scheduler decides *what* a step feeds and *who* gets in; the manager decides *which*
blocks; the engine (``harness.runtime.engine``) runs the step. Admission is
first-come-first-served while the head's prompt (or its first chunk) can be allocated
now, or, for a request swapped out to the host tier, while its blocks and this step's
tokens fit the device; when a running request's append later finds the pool dry, the
most recently admitted is preempted (``harness.runtime.preemption``).

With prefix caching the manager is given token ids (``allocate`` finds the prompt's
cached prefix, ``append`` caches each block its tokens fill); without it, counts, and
nothing is ever cached. Either way each call answers for every KV cache group at once
(``AppendedSlots``).
"""

from collections.abc import Mapping
from dataclasses import dataclass

from harness.runtime.requests import Request, RunningRequest
from harness.runtime.speculation import propose_drafts
from impl import AppendedSlots, KVCacheManager
from spec import BlockAllocationError, GroupKind, RecurrentState, blocks_for_tokens


@dataclass(frozen=True, slots=True)
class Scheduling:
    """What one engine step may feed beyond a whole prompt or one token per request.

    ``speculate = k >= 1``: each greedy decode verifies up to ``k`` prompt-lookup drafts
    in its forward (``harness.runtime.speculation``); sampled requests never speculate.
    ``max_batch_tokens = N``: at most ``N`` tokens per step, decodes (and their drafts)
    first, then prefill chunks; ``None``: no budget, every prompt in one forward.
    ``checkpoint_interval = C`` (a hybrid's): every prefill chunk ends on a multiple of
    ``C``, so the state group checkpoints there (``spec.kinds``: only a chunk's end gets a
    checkpoint); 0: chunks end where the budget does.
    """

    speculate: int = 0
    max_batch_tokens: int | None = None
    checkpoint_interval: int = 0

    def __post_init__(self) -> None:
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 drafts, got {self.speculate}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0, got {self.checkpoint_interval}")


NO_SCHEDULING = Scheduling()


class Scheduler:
    """Chooses each step's tokens and admissions for one manager under one ``Scheduling``,
    giving the manager token ids with ``prefix_caching``, counts without."""

    __slots__ = ("manager", "prefix_caching", "scheduling")

    def __init__(
        self, manager: KVCacheManager, scheduling: Scheduling, *, prefix_caching: bool
    ) -> None:
        self.manager = manager
        self.scheduling = scheduling
        self.prefix_caching = prefix_caching

    def check_fit(self, requests: list[Request]) -> None:
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
            needed = request.blocks_needed(block_size, *group_counts(self.manager.group_windows))
            if needed > self.manager.total_blocks:
                raise ValueError(
                    f"request {request.request_id!r} needs up to {needed} blocks "
                    f"({request.max_tokens} tokens, {request.num_continuations} continuations) "
                    f"but the pool has {self.manager.total_blocks}"
                )

    def admit(self, waiting: RunningRequest, budget: int) -> AppendedSlots | None:
        """Allocate the blocks of ``waiting``'s prompt, or of its first chunk of at most
        ``budget`` tokens, if the pool has them now: the slots of what its first forward
        feeds (past the prefix hit), or ``None`` (the manager changed nothing).

        The prefix hit is over the whole prompt, so a chunk never feeds cached tokens:
        ``allocate(prompt[:hit + chunk])`` finds the same hit (it never covers the last
        token of what it is given, and the chunk has at least one).

        NOTE: no headroom is kept back for running requests: when a decode append later
        finds the pool dry, the most recently admitted request is preempted and recomputed.
        """
        if waiting.swapped:
            return self.resume(waiting, budget)
        request = waiting.request
        # A preempted request comes back with its generated tokens as part of its prompt.
        token_ids = request.prompt_ids + tuple(waiting.output.token_ids)
        salt = request.cache_salt
        hit = self.manager.cached_prefix_tokens(token_ids, salt) if self.prefix_caching else 0
        end = self.chunk_end(hit, min(len(token_ids), hit + budget))
        try:
            if self.prefix_caching:
                appended = self.manager.allocate(request.request_id, token_ids[:end], salt)
            else:
                appended = self.manager.allocate(request.request_id, end)
        except BlockAllocationError:
            return None
        # Our own bug if it fails: the cut prompt must hit exactly the whole prompt's blocks.
        assert appended.cached_tokens == hit, f"hit {appended.cached_tokens} of a chunk, {hit}"
        waiting.prefill_ids = token_ids
        waiting.computed = hit
        waiting.output.prefix_hit_tokens += hit
        waiting.pending_ids = list(token_ids[hit:end])
        waiting.prefill = True
        return appended

    def resume(self, waiting: RunningRequest, budget: int) -> AppendedSlots | None:
        """Bring ``waiting`` back from the host tier (``swap_in``) if the device has room now
        for its blocks and for the tokens it feeds this step (its decode token, or its
        prefill's next chunk of at most ``budget``), and append those: it resumes where it
        was preempted. ``None`` when there is no room (nothing changed).

        NOTE: the room asked for is every group's blocks for all its tokens after this
        step, more than a sliding window keeps: the swap-in and the append after it then
        cannot fail, and a request that fits the pool alone (``check_fit``) always fits an
        empty one.
        """
        manager = self.manager
        pending = (
            self.next_chunk(waiting, budget) if waiting.prefill else [waiting.output.token_ids[-1]]
        )
        tokens = waiting.computed + len(pending)
        room = len(manager.group_windows) * blocks_for_tokens(manager.block_size, tokens)
        if manager.usage().free_blocks < room:
            return None
        manager.swap_in(waiting.request.request_id)
        waiting.swapped = False
        waiting.pending_ids = pending
        return self.append(waiting)

    def append(self, running: RunningRequest) -> AppendedSlots:
        """The one manager call that gives ``running``'s pending tokens (a decode token and
        its drafts, or a prefill chunk) their slots, in every group."""
        pending = running.pending_ids
        tokens = tuple(pending) if self.prefix_caching else len(pending)
        return self.manager.append(running.request.request_id, tokens)

    def grow(
        self,
        running: list[RunningRequest],
        scheduled: list[RunningRequest],
        grown: dict[str, AppendedSlots],
    ) -> RunningRequest | None:
        """Give each of ``scheduled`` not in ``grown`` yet its pending tokens' slots, in order,
        one ``append`` each (``append``'s call, inlined: a decode step's one frame between the
        engine's loop and the manager), filed in ``grown``; ``None`` once all have them.

        When the pool is dry (``BlockAllocationError``): the victim, the most recently
        admitted, leaves ``running`` (and ``scheduled``) and is returned for the caller to
        preempt; the caller then calls again, and the request whose append failed tries
        again (``harness.runtime.preemption.append_or_preempt``'s rule). A victim has not
        appended yet this step, or it is the request whose append failed; victims come last
        admitted first, so a caller that puts each back at the head of its waiting queue
        keeps them in admission order.

        ``scheduled``: ``schedule``'s answer, in running order, so the requests left to grow
        are its end and a scheduled victim is its last.
        """
        append = self.manager.append
        prefix_caching = self.prefix_caching
        index = len(grown)
        while index < len(scheduled):
            current = scheduled[index]
            pending = current.pending_ids
            request_id = current.request.request_id
            try:
                grown[request_id] = append(
                    request_id, tuple(pending) if prefix_caching else len(pending)
                )
            except BlockAllocationError:
                victim = running.pop()
                if scheduled[-1] is victim:
                    scheduled.pop()
                return victim
            index += 1
        return None

    def schedule(self, running: list[RunningRequest]) -> list[RunningRequest]:
        """Choose every running request's tokens for this step (its ``pending_ids``);
        returns those that feed any, in running order.

        Decodes first (each its token and up to ``speculate`` drafts), then the next chunk
        of each unfinished prefill, while ``max_batch_tokens`` lasts; a request left
        without budget waits for the next step.
        """
        budget = self.budget()
        chosen: set[str] = set()
        for current in running:
            if not current.prefill and budget >= 1:
                token_id = current.output.token_ids[-1]
                current.pending_ids = [token_id, *self.drafts(current, budget - 1)]
                budget -= len(current.pending_ids)
                chosen.add(current.request.request_id)
        for current in running:
            if current.prefill and budget >= 1:
                current.pending_ids = self.next_chunk(current, budget)
                budget -= len(current.pending_ids)
                chosen.add(current.request.request_id)
        return [r for r in running if r.request.request_id in chosen]

    def budget(self) -> int:
        """The step's token budget (without one: more than any step can feed)."""
        limit = self.scheduling.max_batch_tokens
        return limit if limit is not None else 1 << 62

    def budget_left(self, running: list[RunningRequest], grown: Mapping[str, object]) -> int:
        """What the step's budget has left after the tokens already scheduled."""
        fed = sum(len(r.pending_ids) for r in running if r.request.request_id in grown)
        return self.budget() - fed

    def drafts(self, running: RunningRequest, budget: int) -> list[int]:
        """Prompt-lookup drafts for a decode (see ``draft_count``)."""
        count = self.draft_count(running, budget)
        if count < 1:
            return []
        output = running.output
        return propose_drafts(running.request.prompt_ids + tuple(output.token_ids), count)

    def draft_count(self, running: RunningRequest, budget: int) -> int:
        """How many drafts a decode may verify: at most ``speculate`` and ``budget``, one
        fewer than the tokens it may still emit (the verify adds its own token), and none
        for a sampled request (acceptance here is greedy's)."""
        if running.generator is not None:
            return 0
        room = running.request.max_new_tokens - len(running.output.token_ids) - 1
        return min(self.scheduling.speculate, budget, room)

    def next_chunk(self, running: RunningRequest, budget: int) -> list[int]:
        """The next at most ``budget`` tokens of an unfinished prefill (to the next
        checkpoint at most)."""
        start = running.computed
        end = self.chunk_end(start, min(len(running.prefill_ids), start + budget))
        return list(running.prefill_ids[start:end])

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk from ``start`` that could run to ``end`` ends: at ``end``, or at
        the first multiple of the checkpoint interval past ``start`` before it."""
        interval = self.scheduling.checkpoint_interval
        if not interval:
            return end
        return min(end, (start // interval + 1) * interval)


def group_counts(group_windows: tuple[GroupKind, ...]) -> tuple[int, int]:
    """How many of ``group_windows`` are attention groups, and how many state groups."""
    states = sum(isinstance(kind, RecurrentState) for kind in group_windows)
    return len(group_windows) - states, states
