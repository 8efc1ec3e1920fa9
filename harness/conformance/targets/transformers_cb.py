"""transformers' continuous-batching KV cache as a conformance target (refinement mode).

The real ``PagedAttentionCache`` of ``transformers.generation.continuous_batching``, built
for a one- or two-layer Llama config on CPU, with its ``CachePool`` and each allocator's
``BlockLedger``. The adapter drives it as the scheduler does: ``search_prefix_match`` then
``can_store_request_tokens`` to admit a prompt, ``count_new_complete_blocks`` and
``mark_complete_blocks`` around each "forward", ``prepare_fork_request`` for a fork,
``free_blocks`` to finish (``no_cache=True`` to preempt, as the offloading manager's soft
reset does), ``evict_cached_blocks`` under memory pressure (as ``offload_requests`` does),
and ``pool.try_to_free_sectors`` after each step so freed blocks return to the shared pool.

Each sector holds one block (the config is sized for it), so a block id is its sector id,
2.. (sectors 0 and 1 are the trash sectors). KV cache group g is the g-th allocator.
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState

import spec
from harness.conformance.adapter import Observation, TargetTable

FULL_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        "refusal_justified/fork": "fork copies a partly filled last block at once, so it may "
        "need a block where the spec shares it and copies on the next append",
        "refusal_atomic": "under memory pressure every cached block is evicted before the "
        "request is refused (OffloadingManager.offload_requests)",
    }
)
SLIDING_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        **FULL_DIFFERENCES,
        "refusal_justified/fork": "fork copies a partly filled last block, and every block "
        "of a sliding-window group, at once",
        "tight_sizing": "a sliding-window group is a ring buffer of ceil(min(L, W) / "
        "block_size) blocks, kept while the request lives: it never releases a block",
        "table_shape": "the ring buffer again: its tables are shorter than the spec's",
        "capacity_respected": "the ring buffer needs fewer blocks than the spec's tables",
        "spec_applicable": "past the window the spec's operations do not apply to a ring "
        "buffer's table (shorter than its tokens); the state properties still do",
    }
)


class TransformersAdapter:
    """A real ``PagedAttentionCache``: full attention, or full + sliding window groups."""

    exact = False
    supports = frozenset({"allocate_prompt", "append_token_ids", "fork", "release", "preempt"})

    def __init__(self, *, sliding_window: int | None = None, block_size: int = 4) -> None:

        layers = (
            ["full_attention"]
            if sliding_window is None
            else ["full_attention", "sliding_attention"]
        )
        # Any: transformers' config takes the layer types and window as extra keywords.
        config_class: Any = LlamaConfig
        config = config_class(
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
        # 12 sectors in all: one block of 16 x 2 x fp16 x 4 tokens = 256 bytes per sector.
        cb_config = ContinuousBatchingConfig(
            page_size=block_size,
            num_blocks=12 // len(layers),
            max_batch_tokens=64,
            max_memory_percent=0.5,
        )
        # Any: transformers objects are the untyped boundary.
        self.cache: Any = PagedAttentionCache(
            config, cb_config, "cpu", DistributedHelper(None, None), dtype=torch.float16
        )
        self.allocators: list[Any] = list(self.cache.cache_allocators.values())
        assert all(a.blocks_per_sector == 1 for a in self.allocators), "one block per sector"
        self.states: dict[str, Any] = {}
        self.block_size = block_size
        self.group_windows: tuple[int | None, ...] = (
            (None,)
            if sliding_window is None
            else (
                None,
                sliding_window,
            )
        )
        self.name = f"transformers PagedAttentionCache windows={list(self.group_windows)}"
        self.differences = FULL_DIFFERENCES if sliding_window is None else SLIDING_DIFFERENCES

    @property
    def pool_block_ids(self) -> Sequence[int]:
        reserved = self.cache.pool.num_reserved_sectors
        return range(reserved, reserved + self.cache.num_sectors)

    # -- operations -----------------------------------------------------------------------

    def allocate_prompt(self, request_id: str, token_ids: tuple[int, ...]) -> int:
        state = RequestState(request_id=request_id, initial_tokens=list(token_ids))
        hit = int(self.cache.search_prefix_match(request_id, list(token_ids)))
        state.position_offset = hit
        try:
            self._forward(state, len(token_ids) - hit, ())
        except spec.BlockAllocationError:
            self.cache.free_blocks(request_id)  # the client gives the starved request up
            self.cache.pool.try_to_free_sectors()
            raise
        self.states[request_id] = state
        return hit

    def append_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        self._forward(self.states[request_id], len(token_ids), token_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        parent = self.states[parent_id]
        self.cache.pool.try_to_free_sectors()
        copies: dict[str, tuple[list[int], list[int]]] = {
            name: ([], []) for name in self.cache.cache_allocators
        }
        forked = self.cache.prepare_fork_request(parent, [child_id], copies)
        if not forked and self.cache.evict_cached_blocks():
            forked = self.cache.prepare_fork_request(parent, [child_id], copies)
        if not forked:
            raise spec.BlockAllocationError.out_of_blocks(child_id, -1, self._free_count())
        self.cache.perform_cache_copy(copies)
        child = RequestState(request_id=child_id, initial_tokens=list(parent.initial_tokens))
        child.generated_tokens = list(parent.generated_tokens)
        child.position_offset = parent.position_offset
        self.states[child_id] = child

    def release(self, request_id: str) -> None:
        self.cache.free_blocks(request_id)
        self.cache.pool.try_to_free_sectors()
        del self.states[request_id]

    def preempt(self, request_id: str) -> None:
        self.cache.free_blocks(request_id, no_cache=True)
        self.cache.pool.try_to_free_sectors()
        del self.states[request_id]

    def _forward(self, state: Any, count: int, generated: tuple[int, ...]) -> None:
        """Find room for ``count`` new tokens (evicting every cached block if that is what
        it takes), then "compute" them: advance the request and hash its completed blocks."""
        if not self.cache.can_store_request_tokens(state, count) and not (
            self.cache.evict_cached_blocks() and self.cache.can_store_request_tokens(state, count)
        ):
            needed = sum(
                a.needs_new_blocks(state.request_id, state.current_len(), count)
                for a in self.allocators
            )
            raise spec.BlockAllocationError.out_of_blocks(
                state.request_id, needed, self._free_count()
            )
        complete = self.cache.count_new_complete_blocks(state, count)
        state.position_offset += count
        state.generated_tokens.extend(generated)
        self.cache.mark_complete_blocks(state, complete)
        self.cache.pool.try_to_free_sectors()

    # -- what it shows --------------------------------------------------------------------

    def _free_count(self) -> int:
        return len(self.observe().free_block_ids)

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
                    request_id: TargetTable(
                        tuple(block_ids),
                        self.states[request_id].position_offset
                        if request_id in self.states
                        else -1,
                    )
                    for request_id, block_ids in allocator.block_table.items()
                }
                for allocator in self.allocators
            ),
            free_block_ids=tuple(free),
            cached_free_block_ids=tuple(b for a in self.allocators for b in a.ledger.cached_blocks),
            cached_block_ids=tuple(frozenset(a.ledger.block_to_hash) for a in self.allocators),
            ref_counts=ref_counts,
        )
