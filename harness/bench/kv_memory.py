"""How much reserved KV memory holds token states, under four ways of reserving it.

The comparison of the PagedAttention paper (Kwon et al., SOSP 2023, Figure 2), replayed on a
trace with allocator work only (no model). One schedule serves every scheme: first-come-
first-served admission into ``max_running`` seats, memory unlimited, one token per running
request per step, release when a request has its last token. At every step each scheme
reserves, for the requests running then:
- contiguous, max length: the trace's longest request (prompt + output), per request;
- contiguous, final length: each request's own prompt + output, from admission (an oracle:
  no server knows the output length in advance);
- paged: whole blocks for the tokens held now (``KVCacheManager.allocate`` and ``append``
  by count);
- paged, prefix sharing: the same by token ids, so a prompt's cached full blocks are
  shared with whoever holds them.
The token states held are the running requests' tokens; with sharing, a shared block's
tokens are stored once, so they are counted once. No external fragmentation is modelled:
a contiguous scheme is charged exactly what it reserves.
"""

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from harness.bench.prefix import VOCABULARY, PromptRequest
from harness.bench.traces import TraceRequest
from impl import KVCacheManager
from spec import blocks_for_tokens

CONTIGUOUS_MAX = "contiguous, max length"
CONTIGUOUS_FINAL = "contiguous, final length (oracle)"
PAGED = "paged"
PAGED_SHARING = "paged, prefix sharing"
SCHEMES = (CONTIGUOUS_MAX, CONTIGUOUS_FINAL, PAGED, PAGED_SHARING)


@dataclass(frozen=True, slots=True)
class KVMemorySeries:
    """Per step of one replay and per scheme: token states stored, token slots reserved."""

    trace_name: str
    block_size: int
    stored: dict[str, list[int]]
    reserved: dict[str, list[int]]

    def share_holding_tokens(self, scheme: str) -> float:
        """Token states stored / slots reserved, summed over the steps (1.0 = no waste)."""
        return sum(self.stored[scheme]) / sum(self.reserved[scheme])


def with_token_ids(trace: Sequence[TraceRequest], seed: int) -> list[PromptRequest]:
    """The length trace with random prompt token ids (so prompts share no prefix)."""
    rng = random.Random(seed)
    return [
        PromptRequest(
            request.request_id,
            tuple(rng.randrange(VOCABULARY) for _ in range(request.prompt_tokens)),
            request.output_tokens,
        )
        for request in trace
    ]


def measure_kv_memory(
    trace_name: str, trace: Sequence[PromptRequest], block_size: int, max_running: int, seed: int
) -> KVMemorySeries:
    """Replay ``trace`` once and record every scheme's memory at every step."""
    rng = random.Random(seed)
    longest = max(len(request.token_ids) + request.output_tokens for request in trace)
    # Enough blocks for every request at once: memory never limits the schedule.
    total_blocks = sum(
        blocks_for_tokens(block_size, len(request.token_ids) + request.output_tokens)
        for request in trace
    )
    paged = KVCacheManager(total_blocks, block_size)
    sharing = KVCacheManager(total_blocks, block_size)
    stored: dict[str, list[int]] = {scheme: [] for scheme in SCHEMES}
    reserved: dict[str, list[int]] = {scheme: [] for scheme in SCHEMES}
    waiting = deque(trace)
    running: list[PromptRequest] = []
    generated: dict[str, int] = {}
    final_tokens = 0  # prompt + output of every running request
    while waiting or running:
        while waiting and len(running) < max_running:
            request = waiting.popleft()
            paged.allocate(request.request_id, len(request.token_ids))
            sharing.allocate(request.request_id, request.token_ids)
            running.append(request)
            generated[request.request_id] = 0
            final_tokens += len(request.token_ids) + request.output_tokens
        usage = paged.usage()
        waste = usage.reserved_tokens - usage.allocated_tokens  # the partly filled last blocks
        sharing_slots = sharing.usage().used_blocks * block_size
        for scheme, slots, tokens in (
            (CONTIGUOUS_MAX, len(running) * longest, usage.allocated_tokens),
            (CONTIGUOUS_FINAL, final_tokens, usage.allocated_tokens),
            (PAGED, usage.reserved_tokens, usage.allocated_tokens),
            # No forks here, so no shared block is partly filled: the same waste as paged.
            (PAGED_SHARING, sharing_slots, sharing_slots - waste),
        ):
            reserved[scheme].append(slots)
            stored[scheme].append(tokens)
        still_running = []
        for request in running:
            request_id = request.request_id
            generated[request_id] += 1
            if generated[request_id] < request.output_tokens:
                paged.append(request_id, 1)
                sharing.append(request_id, (rng.randrange(VOCABULARY),))
                still_running.append(request)
            else:
                paged.release(request_id)
                sharing.release(request_id)
                final_tokens -= len(request.token_ids) + request.output_tokens
        running = still_running
    return KVMemorySeries(trace_name, block_size, stored, reserved)
