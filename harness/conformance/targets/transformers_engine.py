"""transformers' continuous batching as a conformance target (refinement mode).

The real ``ContinuousBatchProcessor`` of ``transformers.generation.continuous_batching``
(what ``ContinuousBatchingManager`` runs in its generation thread), with its
``FIFOScheduler``, ``OffloadingManager`` and ``PagedAttentionCache`` (its ``CachePool`` and
each allocator's ``BlockLedger``), built for a one- or two-layer Llama config on CPU. Each
engine step is the manager's loop body: ``prepare_next_batch()`` (cancellations, the
scheduler's batch with its prefix matches, soft resets of requests under memory pressure,
the batch tensors), a stub forward that writes the kit's sampled tokens where the model's
would go (``output_ids``), and ``update_batch()`` (each request's new token, completion
check, the hashes of the blocks the forward completed, the finish). Requests arrive as a
``RequestState`` in the scheduler's waiting queue; a cancellation is processed at once, as
the next step would. No forward is computed: the allocator never reads the K/V.

The adapter only watches: it wraps the cache's ``search_prefix_match`` and
``can_store_request_tokens`` (an admission: ``allocate_prompt``; a running request:
``append_token_ids``), ``mark_complete_blocks`` (``cache_blocks``: the spec caches in the
adding operation, transformers after the forward), ``free_blocks`` (``preempt`` when a
soft reset frees without caching, else ``release``) and ``evict_cached_blocks``
(``evict``), and reports each call with what the cache showed around it.

Each sector holds one block (the config is sized for it), so a block id is its sector id,
2.. (sectors 0 and 1 are the trash sectors). KV cache group g is the g-th allocator.
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus,
    ContinuousBatchProcessor,
    OutputRouter,
)
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import (
    resolve_continuous_batching_config,
)
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler
from transformers.generation.logits_process import LogitsProcessorList

from harness.conformance.adapter import Call, Observation, Outcome, TargetTable, record_calls

STOP_TOKEN = 7  # outside the kit's vocabulary (0..3): the stub model samples it to finish

FULL_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        "eviction_justified": "under memory pressure, and below the scheduler's safety "
        "margin, every cached block is evicted (evict_cached_blocks), and a soft reset "
        "frees the preempted request's blocks uncached (free_blocks(no_cache=True))",
        "refusal_justified": "can_store_request_tokens counts free sectors only: cached "
        "blocks are evicted when no request can be scheduled at all (offload_requests) or "
        "below the safety margin, so a request can wait while evictable blocks remain",
        "refusal_atomic/allocate_prompt": "the prefix match takes the hit blocks before the "
        "scheduler knows the rest fits; when it does not, the request keeps them and waits "
        "(PREFILLING), its next allocation extends them",
    }
)
SLIDING_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        **FULL_DIFFERENCES,
        "computed_findable": "with a sliding-window layer, prefix sharing is off "
        "(PagedAttentionCache.use_prefix_sharing is False): no block is ever cached",
        "tight_sizing": "a sliding-window group is a ring buffer of ceil(min(L, W) / "
        "block_size) blocks, kept while the request lives: it never releases a block",
        "table_shape": "the ring buffer again: its tables are shorter than the spec's",
        "capacity_respected": "the ring buffer needs fewer blocks than the spec's tables",
        "spec_applicable": "past the window the spec's operations do not apply to a ring "
        "buffer's table (shorter than its tokens); the state properties still do",
    }
)


# The findings (docs/findings/), declared only when a run asks to look past them.
FINDINGS: Mapping[str, str] = MappingProxyType(
    {
        "computed_findable/release": "FINDING docs/findings/transformers-last-forward.md: "
        "the blocks a request's last forward completes are never cached (update_batch "
        "marks them after update_and_check_completion set FINISHED)"
    }
)


def llama_config(sliding_window: int | None) -> Any:  # Any: transformers' config
    """A one-layer Llama config (full attention), or a full layer beside a sliding-window
    layer of ``sliding_window`` tokens: one block of 4 tokens fills a 256-byte sector."""
    layers = ["full_attention"]
    if sliding_window is not None:
        layers.append("sliding_attention")
    # Any: transformers' config takes the layer types and window as extra keywords.
    config_class: Any = LlamaConfig
    return config_class(
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=len(layers),
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=16,
        layer_types=layers if sliding_window is not None else None,
        sliding_window=sliding_window,
    )


class TransformersEngine:
    """A real ``ContinuousBatchProcessor``: full attention, or full + sliding window groups."""

    exact = False
    supports: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        sliding_window: int | None = None,
        block_size: int = 4,
        known_findings: bool = False,
    ) -> None:
        config = llama_config(sliding_window)
        # 12 sectors in all: one block of 16 x 2 x fp16 x 4 tokens = 256 bytes per sector;
        # a token budget no batch of the kit's requests reaches (no prefill is split).
        # Any: the resolved config is transformers' (its fields typed as the unresolved ones).
        cb_config: Any = resolve_continuous_batching_config(
            config,
            ContinuousBatchingConfig(
                page_size=block_size,
                num_blocks=12 // config.num_hidden_layers,
                max_batch_tokens=256,
                max_memory_percent=0.5,
                use_async_batching=False,
                max_blocks_per_request=0,
                scheduler_type="fifo",
            ),
            None,
            has_logit_processors=False,
            device=torch.device("cpu"),
        )
        helper = DistributedHelper(None, None)
        # Any: transformers objects are the untyped boundary.
        self.cache: Any = PagedAttentionCache(config, cb_config, "cpu", helper, dtype=torch.float16)
        scheduler = FIFOScheduler(
            self.cache, cb_config.safety_margin, cb_config.max_requests_per_batch
        )
        self.processor: Any = ContinuousBatchProcessor(
            self.cache,
            config,
            GenerationConfig(),
            cb_config,
            ContinuousBatchingLogitsProcessorList(LogitsProcessorList()),
            None,
            None,
            OutputRouter(),
            BackgroundThreadStatus(),
            torch.device("cpu"),
            torch.float16,
            scheduler,
            helper,
        )
        self.allocators: list[Any] = list(self.cache.cache_allocators.values())
        assert all(a.blocks_per_sector == 1 for a in self.allocators), "one block per sector"
        self.block_size = block_size
        self.group_windows: tuple[int | None, ...] = (
            (None,) if sliding_window is None else (None, sliding_window)
        )
        self.name = f"transformers ContinuousBatchProcessor windows={list(self.group_windows)}"
        differences = FULL_DIFFERENCES if sliding_window is None else SLIDING_DIFFERENCES
        self.differences = {**differences, **(FINDINGS if known_findings else {})}
        # Tokens each request holding blocks has slots for (what its tables cover).
        self.slot_tokens: dict[str, int] = {}
        self.calls: list[Call] = []
        self._matched: tuple[str, int, Observation] | None = None
        self._watch()

    @property
    def pool_block_ids(self) -> Sequence[int]:
        reserved = self.cache.pool.num_reserved_sectors
        return range(reserved, reserved + self.cache.num_sectors)

    # -- what the manager's generation loop does ---------------------------------------------

    def submit(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> None:
        state = RequestState(
            request_id=request_id,
            initial_tokens=list(token_ids),
            max_new_tokens=None,
            eos_token_id=STOP_TOKEN,
        )
        self.processor.scheduler.add_waiting_request(state)

    def step(self, sampled: Mapping[str, int], finishing: frozenset[str]) -> list[Call]:
        self.calls = []
        return record_calls(self.calls, lambda: self._step(sampled, finishing))

    def _step(self, sampled: Mapping[str, int], finishing: frozenset[str]) -> None:
        if not self.processor.prepare_next_batch():
            return
        io = self.processor.inputs_and_outputs
        # The stub forward: the sampled token of each request that gets one, in batch order.
        index = 0
        for future in io.requests_in_batch:
            if future.has_new_token:
                request_id = future.state.request_id
                token = STOP_TOKEN if request_id in finishing else sampled[request_id]
                io.output_ids[0, index] = token
                index += 1
        self.processor.update_batch()

    def abort(self, request_id: str) -> list[Call]:
        self.calls = []
        return record_calls(self.calls, lambda: self._cancel(request_id))

    def _cancel(self, request_id: str) -> None:
        scheduler = self.processor.scheduler
        scheduler.set_request_cancellation(request_id)
        scheduler.clear_cancelled_requests()  # what the next prepare_next_batch does first

    # -- watching the cache -------------------------------------------------------------------

    def _watch(self) -> None:
        cache = self.cache
        search, can_store, mark = (
            cache.search_prefix_match,
            cache.can_store_request_tokens,
            cache.mark_complete_blocks,
        )
        free_blocks, evict = cache.free_blocks, cache.evict_cached_blocks

        def watched_search(request_id: str, prompt_ids: list[int]) -> int:
            self._close_match()
            before = self.observe()
            hit = int(search(request_id, prompt_ids))
            self._matched = (request_id, hit, before)
            if hit:
                self.slot_tokens[request_id] = hit
            return hit

        def watched_can_store(state: Any, request_len: int, dry_run: bool = False) -> bool:
            if dry_run:
                return bool(can_store(state, request_len, dry_run))
            request_id = state.request_id
            matched = self._matched if self._matched and self._matched[0] == request_id else None
            if matched is None:
                self._close_match()
            self._matched = None
            admitting = matched is not None or request_id not in self.slot_tokens
            before = matched[2] if matched else self.observe()
            hit = matched[1] if matched else 0
            pending = (
                state.tokens_to_process
                if state.status == RequestStatus.DECODING
                else state.remaining_prefill_tokens
            )
            stored = bool(can_store(state, request_len))
            if admitting:
                token_ids = tuple(state.initial_tokens[: hit + request_len])
                outcome = Outcome(hit) if stored else Outcome(refusal="no free blocks")
                call = Call("allocate_prompt", (request_id, token_ids), outcome, before, before)
                end = hit + request_len
            else:
                start = self.slot_tokens[request_id]
                token_ids = tuple(pending[:request_len])
                outcome = Outcome() if stored else Outcome(refusal="no free blocks")
                call = Call("append_token_ids", (request_id, token_ids), outcome, before, before)
                end = start + request_len
            if stored:
                self.slot_tokens[request_id] = end
            self.calls.append(_after(call, self.observe()))
            return stored

        def watched_mark(state: Any, complete_blocks: dict[str, int]) -> None:
            self._close_match()
            before = self.observe()
            mark(state, complete_blocks)
            call = Call("cache_blocks", (state.request_id,), Outcome(), before, self.observe())
            self.calls.append(call)

        def watched_free(request_id: str, no_cache: bool = False) -> None:
            self._close_match()
            before = self.observe()
            free_blocks(request_id, no_cache)
            if self.slot_tokens.pop(request_id, None) is not None:
                operation = "preempt" if no_cache else "release"
                self.calls.append(Call(operation, (request_id,), Outcome(), before, self.observe()))

        def watched_evict() -> bool:
            self._close_match()
            before = self.observe()
            evicted = bool(evict())
            if evicted:
                self.calls.append(Call("evict", (), Outcome(), before, self.observe()))
            return evicted

        cache.search_prefix_match = watched_search
        cache.can_store_request_tokens = watched_can_store
        cache.mark_complete_blocks = watched_mark
        cache.free_blocks = watched_free
        cache.evict_cached_blocks = watched_evict

    def _close_match(self) -> None:
        """A prefix match the scheduler did not follow with an allocation (its budget ran
        out first) is an admission that kept its hit blocks without the rest: refused."""
        if self._matched is None:
            return
        request_id, hit, before = self._matched
        self._matched = None
        if not hit:
            return  # nothing was taken: the request just waits
        state = self.processor.scheduler.active_requests.get(request_id)
        token_ids = tuple(state.initial_tokens) if state is not None else ()
        outcome = Outcome(refusal="not scheduled this step")
        call = Call("allocate_prompt", (request_id, token_ids), outcome, before, self.observe())
        self.calls.append(call)

    # -- what it shows ------------------------------------------------------------------------

    def observe(self) -> Observation:
        pool = self.cache.pool
        free = list(pool.free_sectors)
        for allocator in self.allocators:
            for leaves in pool._free_blocks[allocator.index].trees.values():
                free.extend(leaves)
        ref_counts: dict[int, int] = {}
        for allocator in self.allocators:
            for block_ids in allocator.block_table.values():
                for block_id in block_ids:
                    ref_counts[block_id] = allocator.ledger.shared_ref_counts.get(block_id, 1)
        return Observation(
            tables=tuple(
                {
                    request_id: TargetTable(tuple(block_ids), self.slot_tokens[request_id])
                    for request_id, block_ids in allocator.block_table.items()
                    if request_id in self.slot_tokens
                }
                for allocator in self.allocators
            ),
            # Sorted: moving a free block between the allocator's leaves and the pool's free
            # sectors (try_to_free_sectors) changes no block's state.
            free_block_ids=tuple(sorted(free)),
            cached_free_block_ids=tuple(
                sorted(b for a in self.allocators for b in a.ledger.cached_blocks)
            ),
            cached_block_ids=tuple(frozenset(a.ledger.block_to_hash) for a in self.allocators),
            ref_counts=ref_counts,
        )


def _after(call: Call, after: Observation) -> Call:
    return Call(call.operation, call.args, call.outcome, call.before, after)
