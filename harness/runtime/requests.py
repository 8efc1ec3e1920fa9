"""A request and its records: what a caller asks (``Request``, ``SamplingParams``), what it
gets back (``RequestOutput``), and what the engine keeps while serving it
(``RunningRequest``).

Records only: the scheduler (``harness.runtime.scheduler``) decides what each step feeds,
the engine (``harness.runtime.engine``) runs the steps.
"""

from dataclasses import dataclass, field, replace

import torch

from spec import blocks_for_tokens


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature and top-p with a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt (token ids) to extend by up to ``max_new_tokens``, arriving at ``arrival_step``.

    ``num_continuations = n > 1`` asks for ``n`` greedy continuations with distinct first
    tokens (``continuation_first_tokens``); continuation ``k > 0`` is reported under
    ``continuation_id(request_id, k)``. ``cache_salt`` is its tenant's: its prompt hits
    only blocks cached under the same salt (``None``: no salt).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY
    num_continuations: int = 1
    cache_salt: str | None = None

    @property
    def max_tokens(self) -> int:
        """The most tokens this request can hold: prompt plus every new token."""
        return len(self.prompt_ids) + self.max_new_tokens

    def blocks_needed(self, block_size: int, group_count: int = 1, state_groups: int = 0) -> int:
        """The most blocks all its continuations hold at once, alone in a pool of
        ``group_count`` attention KV cache groups and ``state_groups`` recurrent state
        groups.

        They share the prompt's full blocks; each needs the rest of its own up to
        ``max_tokens`` (a copy of a shared partly filled block included). Each group holds
        the whole prompt's blocks until a decode skips some, so with several groups a
        request may need its blocks once per group. In a state group each continuation
        holds one block, and two while a checkpoint's copy is pending (``spec.kinds``).
        """
        shared = len(self.prompt_ids) // block_size  # the prompt's full blocks
        own = blocks_for_tokens(block_size, self.max_tokens) - shared
        states = state_groups * 2 * self.num_continuations
        return group_count * (shared + self.num_continuations * own) + states

    @property
    def sequence_ids(self) -> list[str]:
        """The ids its continuations are reported under: its own, then the children's."""
        return [continuation_id(self.request_id, k) for k in range(self.num_continuations)]


def continuation_id(request_id: str, rank: int) -> str:
    """Continuation ``rank`` of a request: rank 0 is the request itself, then ``"{id}/{k}"``."""
    return request_id if rank == 0 else f"{request_id}/{rank}"


@dataclass(slots=True)
class RequestOutput:
    """What a request produced: tokens, the float32 logits each was chosen from, blocks held."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # each [vocab] float32, host
    max_blocks: int = 0
    prefill_chunks: int = 0  # forwards that fed its prompt (a recompute's included)
    prefix_hit_tokens: int = 0  # prompt tokens its admissions found cached (a recompute's too)


@dataclass(slots=True)
class RunningRequest:
    """What the engine keeps of a request it serves: its tokens to feed next and how far
    its K/V are computed. A waiting request (not yet admitted, or preempted) has one too."""

    request: Request  # a child continuation's is its parent's with the child's id and n = 1
    output: RequestOutput
    generator: torch.Generator | None
    pending_ids: list[int]  # tokens whose K/V the next forward computes (a chunk, or a
    # decode's token and its drafts)
    prefill: bool = True  # it is feeding the tokens of its (re)admission, chunk by chunk
    prefill_ids: tuple[int, ...] = ()  # the tokens its (re)admission prefills
    computed: int = 0  # tokens of its table whose K/V are in the pool
    swapped: bool = False  # its K/V wait in the host tier: it resumes where it stopped
    dropped: int = 0  # tokens whose K/V a recompute preemption dropped: its prefill of
    # positions below this recomputes them

    @property
    def last_chunk(self) -> bool:
        """Whether its pending tokens end its prefill (the forward then samples a token)."""
        return self.computed + len(self.pending_ids) == len(self.prefill_ids)

    def is_finished(self, eos_token_id: int | None) -> bool:
        """Whether it emitted its last token: ``max_new_tokens`` of them, or an eos."""
        token_ids = self.output.token_ids
        if not token_ids:
            return False  # still prefilling
        if len(token_ids) >= self.request.max_new_tokens:
            return True
        return eos_token_id is not None and token_ids[-1] == eos_token_id

    @property
    def logit_rows(self) -> int:
        """How many of its pending tokens' logits the next forward keeps."""
        if self.prefill:
            return 1 if self.last_chunk else 0
        return len(self.pending_ids)


def new_running(request: Request) -> RunningRequest:
    """The record of ``request`` before its admission: nothing fed, nothing emitted."""
    generator = None
    if request.sampling.temperature > 0:
        # On the host, where the logits are sampled: the same draws on every device.
        generator = torch.Generator()
        generator.manual_seed(request.sampling.seed)
    return RunningRequest(
        request=request,
        output=RequestOutput(request.request_id, len(request.prompt_ids)),
        generator=generator,
        pending_ids=[],
    )


def new_child(
    parent: RunningRequest, child_id: str, token_id: int, logits: torch.Tensor
) -> RunningRequest:
    """The record of a continuation forked from ``parent`` right after its prefill: the
    parent's request under ``child_id`` (one continuation), its first token ``token_id``
    chosen from ``logits`` ``[vocab]``, and the parent's computed K/V (shared blocks)."""
    request = parent.request
    output = RequestOutput(
        child_id,
        len(request.prompt_ids),
        [token_id],
        [logits],
        parent.output.max_blocks,
        parent.output.prefill_chunks,
    )
    return RunningRequest(
        request=replace(request, request_id=child_id, num_continuations=1),
        output=output,
        generator=None,
        pending_ids=[token_id],
        prefill=False,
        computed=parent.computed,
    )
