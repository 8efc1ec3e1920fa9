"""vLLM v1's scheduler over its ``KVCacheManager`` as a conformance target (refinement mode).

The real package (``scripts/setup.sh`` installs the 'conformance' pins without their
dependencies), on CPU: the real ``vllm.v1.core.sched.scheduler.Scheduler`` built from a
``VllmConfig`` of a one-layer Llama (read from a config.json the adapter writes; no weights,
no model runner), with prefix caching on, over a ``KVCacheConfig`` of one full-attention
group, or a full group beside a sliding-window group (a hybrid model;
``harness.conformance.targets.vllm_mamba`` builds on it for a Mamba group). Each engine step is
what vLLM's engine core does: ``schedule()``, a stub model that samples the kit's tokens
(``ModelRunnerOutput``), ``update_from_output()``; requests arrive by ``add_request`` and
are cancelled by ``finish_requests(..., FINISHED_ABORTED)``. The scheduler admits,
decodes, preempts (mid-step, when a running request cannot get a block) and finishes as
vLLM does, and a request's last forward is followed by its finish in the same step.

The adapter only watches: it wraps the ``KVCacheManager`` instance's ``get_computed_blocks``,
``allocate_slots`` and ``free`` to report each call, in the spec's vocabulary, with what the
pool showed around it: an admission (``get_computed_blocks`` + ``allocate_slots`` of a
request without blocks) is ``allocate_prompt``, a running request's ``allocate_slots`` is
``append_token_ids``, ``free`` is ``preempt`` for a running request, else ``release``.

It watches the scheduler's KV cache events the same way: the ``VllmConfig`` turns them on
(``KVEventsConfig``, the null publisher), the scheduler publishes one ``KVEventBatch`` at
the end of each step (``update_from_output``), and the adapter keeps each batch its
publisher's ``publish`` is given, for ``take_events()`` (``harness.conformance.events``).

vLLM's own order policy is not the spec's (freed blocks go to one free queue, uncached ones
at its head, cached ones at its tail; block 0 is the null block standing for skipped
blocks), so only what must hold whatever the order is compared.
"""

import functools
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_group_id, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import spec
from harness.conformance.adapter import (
    CACHE_SALT,
    KV_EVENTS,
    Call,
    Observation,
    Outcome,
    TargetTable,
    record_calls,
)
from harness.conformance.events import TargetEvent, TargetRemoved, TargetStored
from harness.conformance.targets.vllm_differences import (
    FINDINGS,
    FULL_DIFFERENCES,
    HYBRID_DIFFERENCES,
)

STOP_TOKEN = 7  # outside the kit's vocabulary (0..3): the stub model samples it to finish

init_none_hash(sha256)


@functools.cache
def vllm_config(
    block_size: int, total_blocks: int, token_budget: int = 2048, mamba_align: bool = False
) -> Any:  # Any: vLLM's config
    """The ``VllmConfig`` of a one-layer Llama on the CPU platform, once per process
    (building its ``ModelConfig`` inspects the architecture: seconds). ``token_budget``
    is the scheduler's tokens per step; ``mamba_align`` sets the cache config a hybrid
    Mamba model with prefix caching gets (``mamba_cache_mode="align"``, whose prefills
    the scheduler splits on the block grid)."""
    model_dir = tempfile.mkdtemp(prefix="pagedkv-vllm-")
    LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=16,
        max_position_embeddings=4096,
    ).save_pretrained(model_dir)
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=4096)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = total_blocks + 1  # and the null block
    if mamba_align:
        cache.mamba_cache_mode = "align"
    # The default budget is one no batch of the kit's requests reaches: no prefill is chunked.
    scheduler = SchedulerConfig(
        max_num_batched_tokens=token_budget,
        max_num_seqs=8,
        max_model_len=4096,
        is_encoder_decoder=False,
    )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=scheduler,
        device_config=DeviceConfig(device="cpu"),
        # The scheduler's KVCacheManager emits KV cache events; the scheduler publishes each
        # step's (update_from_output) to its null publisher, which the adapter watches.
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


class VLLMEngine:
    """The real vLLM v1 ``Scheduler`` over ``total_blocks`` usable blocks (plus the null one)."""

    exact = False
    supports = frozenset({CACHE_SALT, KV_EVENTS})

    def __init__(
        self,
        *,
        sliding_window: int | None = None,
        block_size: int = 4,
        total_blocks: int = 12,
        known_findings: bool = False,
    ) -> None:
        windows: tuple[int | None, ...] = (
            (None,) if sliding_window is None else (None, sliding_window)
        )
        differences = FULL_DIFFERENCES if sliding_window is None else HYBRID_DIFFERENCES
        self._start(
            group_windows=windows,
            specs=[_attention(block_size, window) for window in windows],
            config=vllm_config(block_size, total_blocks),
            differences={**differences, **(FINDINGS if known_findings else {})},
            name=f"vllm Scheduler windows={list(windows)}",
        )

    def _start(
        self,
        *,
        group_windows: tuple[spec.GroupEntry, ...],
        specs: list[Any],  # Any: vLLM's KVCacheSpec classes
        config: Any,  # Any: vLLM's config
        differences: Mapping[str, str],
        name: str,
        retention_interval: int | None = None,
    ) -> None:
        """Build the scheduler over one KV cache group per spec of ``specs``."""
        self.group_windows = group_windows
        block_size = config.cache_config.block_size
        total_blocks = config.cache_config.num_gpu_blocks - 1
        groups = [KVCacheGroupSpec([f"layer.{g}"], kind) for g, kind in enumerate(specs)]
        kv_cache = KVCacheConfig(
            num_blocks=total_blocks + 1,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention_interval,
        )
        # Any: vLLM objects are the untyped boundary.
        self.scheduler: Any = Scheduler(
            config, kv_cache, StructuredOutputManager(config), block_size=block_size
        )
        self.manager: Any = self.scheduler.kv_cache_manager
        self.hasher: Any = get_request_block_hasher(block_size, sha256)
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.name = name
        self.differences = dict(differences)
        # Tokens each request holding blocks has slots for (what its tables cover).
        self.slot_tokens: dict[str, int] = {}
        self.calls: list[Call] = []
        # An admission's request, what the pool showed before it and its prefix hit.
        self._admitting: tuple[str, Observation, Any] | None = None
        # What the pool showed after a call reported inside an allocate_slots, if any.
        self._landed: Observation | None = None
        self._watch()
        # The KVEventBatches the scheduler published since the last take_events().
        self.published: list[Any] = []
        publisher: Any = self.scheduler.kv_event_publisher
        publish = publisher.publish

        def watched_publish(batch: Any) -> None:
            self.published.append(batch)
            publish(batch)

        publisher.publish = watched_publish

    @property
    def pool_block_ids(self) -> Sequence[int]:
        return range(1, self.total_blocks + 1)  # block 0 is the null block

    # -- what the engine core does ----------------------------------------------------------

    def submit(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> None:
        params = SamplingParams(max_tokens=1 << 20, stop_token_ids=[STOP_TOKEN])
        request = Request(
            request_id,
            list(token_ids),
            params,
            None,
            cache_salt=cache_salt,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)

    def step(self, sampled: Mapping[str, int], finishing: frozenset[str]) -> list[Call]:
        self.calls = []
        return record_calls(self.calls, lambda: self._step(sampled, finishing))

    def _step(self, sampled: Mapping[str, int], finishing: frozenset[str]) -> None:
        scheduled = self.scheduler.schedule()
        request_ids = list(scheduled.num_scheduled_tokens)
        # As the model runner does, a chunk that does not finish its prompt samples nothing.
        requests = self.scheduler.requests
        tokens = [
            []
            if requests[r].num_computed_tokens < requests[r].num_tokens
            else [STOP_TOKEN if r in finishing else sampled[r]]
            for r in request_ids
        ]
        output = ModelRunnerOutput(
            req_ids=request_ids, sampled_token_ids=tokens, **_index_of(request_ids)
        )
        self.scheduler.update_from_output(scheduled, output)

    def abort(self, request_id: str) -> list[Call]:
        self.calls = []
        aborted = RequestStatus.FINISHED_ABORTED
        return record_calls(self.calls, lambda: self.scheduler.finish_requests(request_id, aborted))

    # -- watching the allocator ---------------------------------------------------------------

    def _watch(self) -> None:
        manager = self.manager
        get_computed_blocks, allocate_slots, free = (
            manager.get_computed_blocks,
            manager.allocate_slots,
            manager.free,
        )

        def watched_get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            before = self.observe()
            found = get_computed_blocks(request, *args, **kwargs)
            self._admitting = (request.request_id, before, found[0])
            return found

        def watched_allocate_slots(
            request: Any,
            num_new_tokens: int,
            num_new_computed_tokens: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            request_id = request.request_id
            admitting = request_id not in self.slot_tokens
            pending, self._admitting = self._admitting, None
            mine = pending if pending and pending[0] == request_id else None
            before = mine[1] if mine else self.observe()
            self._landed = None
            blocks = allocate_slots(
                request, num_new_tokens, num_new_computed_tokens, *args, **kwargs
            )
            # A call the allocation made first (take_copies) ends where this one starts.
            before = self._landed or before
            start = 0 if admitting else self.slot_tokens[request_id]
            end = (num_new_computed_tokens if admitting else start) + num_new_tokens
            token_ids = tuple(request.all_token_ids[start:end])
            if blocks is not None:
                self.slot_tokens[request_id] = end
            operation, result = "append_token_ids", None
            call_args: tuple[object, ...] = (request_id, token_ids)
            if admitting:
                operation, result = "allocate_prompt", num_new_computed_tokens
                call_args = (request_id, token_ids, request.cache_salt)
            outcome = Outcome(result)
            if blocks is None:
                outcome = Outcome(refusal=self._refusal(admitting, mine[2] if mine else None))
            self.calls.append(Call(operation, call_args, outcome, before, self.observe()))
            return blocks

        def watched_free(request: Any) -> None:
            request_id = request.request_id
            before = self.observe()
            free(request)
            if self.slot_tokens.pop(request_id, None) is not None:
                operation = "release" if request.is_finished() else "preempt"
                self.calls.append(Call(operation, (request_id,), Outcome(), before, self.observe()))

        manager.get_computed_blocks = watched_get_computed_blocks
        manager.allocate_slots = watched_allocate_slots
        manager.free = watched_free

    # -- what it shows ------------------------------------------------------------------------

    def take_events(self) -> list[TargetEvent]:
        """The events of the ``KVEventBatch``es the scheduler published since the last
        call (``vllm.distributed.kv_events`` records, in the kit's neutral shape)."""
        batches, self.published = self.published, []
        return [_neutral(event) for batch in batches for event in batch.events]

    def _refusal(self, admitting: bool, hit_blocks: Any) -> str:  # Any: KVCacheBlocks
        """Why ``allocate_slots`` returned ``None``: a capacity refusal (a target with
        another reason reports it here)."""
        return "no free blocks"

    def observe(self) -> Observation:
        pool = self.manager.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        cached: list[set[int]] = [set() for _ in self.group_windows]
        for block in pool.blocks:
            if block.block_hash is not None and not block.is_null:
                cached[get_group_id(block.block_hash)].add(block.block_id)
        tables = []
        ref_counts: dict[int, int] = {}
        in_flight: list[int] = []
        copies: list[tuple[int, int]] = []
        managers = self.manager.coordinator.single_type_managers
        for group, manager in enumerate(managers):
            group_tables = {}
            for request_id, blocks in manager.req_to_blocks.items():
                if request_id not in self.slot_tokens:
                    continue  # a refused admission's empty entry (req_to_blocks is a defaultdict)
                shown = self._table(group, blocks, self.slot_tokens[request_id])
                for block_id in shown.table.block_ids:
                    ref_counts[block_id] = pool.blocks[block_id].ref_cnt
                group_tables[request_id] = shown.table
                in_flight += shown.in_flight
                copies += shown.copies
            tables.append(group_tables)
        return Observation(
            tables=tuple(tables),
            free_block_ids=tuple(b.block_id for b in free if b.block_hash is None),
            cached_free_block_ids=tuple(b.block_id for b in free if b.block_hash is not None),
            cached_block_ids=tuple(frozenset(ids) for ids in cached),
            ref_counts=ref_counts,
            # A checkpoint two requests hit is the source of both their copies.
            in_flight_block_ids=tuple(dict.fromkeys(in_flight)),
            pending_copies=tuple(copies),
        )

    def _table(self, group: int, blocks: Sequence[Any], token_count: int) -> "ShownTable":
        """One request's table in ``group`` (``blocks``: its ``req_to_blocks`` entry), as the
        spec sees it. An attention group's leading null blocks are the skipped ones."""
        skipped = 0
        while skipped < len(blocks) and blocks[skipped].is_null:
            skipped += 1
        held = tuple(block.block_id for block in blocks[skipped:])
        return ShownTable(TargetTable(held, token_count, skipped))


@dataclass(frozen=True, slots=True)
class ShownTable:
    """A request's table as the adapter shows it, and the blocks it holds outside the spec's
    table shape: copy sources in flight and the copies that read them (source, destination)."""

    table: TargetTable
    in_flight: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()


def _attention(block_size: int, window: int | None) -> Any:  # Any: vLLM's spec classes
    if window is None:
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
        )
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )


def _neutral(event: Any) -> TargetEvent:  # Any: a vllm.distributed.kv_events record
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return spec.AllBlocksCleared()
    if kind == "BlockRemoved":
        return TargetRemoved(tuple(event.block_hashes), event.group_idx, event.medium)
    # The cache salt is the only extra key the kit's requests have (the first block's).
    first_keys = event.extra_keys[0] if event.extra_keys else None
    salt = first_keys[0] if first_keys and event.parent_block_hash is None else None
    return TargetStored(
        tuple(event.block_hashes),
        event.parent_block_hash,
        tuple(event.token_ids),
        salt,
        event.group_idx,
        event.medium,
    )


# Any: keyword arguments of vLLM's ModelRunnerOutput, whose fields differ between releases.
def _index_of(request_ids: list[str]) -> dict[str, Any]:
    """``ModelRunnerOutput``'s ``req_id_to_index``, which vLLM 0.33 takes (required) and 0.34
    dropped (each request's row is its place in ``req_ids``)."""
    if "req_id_to_index" not in ModelRunnerOutput.__dataclass_fields__:
        return {}
    return {"req_id_to_index": {r: i for i, r in enumerate(request_ids)}}
