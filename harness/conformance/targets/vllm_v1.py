"""vLLM v1's ``KVCacheManager`` (with its ``BlockPool``) as a conformance target (refinement).

The real package (``pip install -e '.[conformance]'``, see ``scripts/setup.sh``), on CPU:
a ``KVCacheConfig`` with one full-attention group, or a full group beside a sliding-window
group (a hybrid model), prefix caching on, real ``Request``s with vLLM's block hasher. The
adapter drives it as vLLM's scheduler does: ``get_computed_blocks`` then ``allocate_slots``
to admit a prompt (the request carries the step's ``cache_salt``, which vLLM's block
hasher mixes into the extra keys of each chain's first block, so the whole chain hashes
apart; ``kv_cache_utils.generate_block_hash_extra_keys``), ``append_output_token_ids``
then ``allocate_slots`` for each decode step (``num_computed_tokens`` advanced after
each, as a forward pass does), ``free`` to finish or preempt. vLLM has no fork and no rollback.

vLLM's own order policy is not the spec's (freed blocks go to one free queue, cached or
not, and eviction takes its head; block 0 is the null block standing for skipped blocks),
so only what must hold whatever the order is compared.
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_group_id, get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

import spec
from harness.conformance.adapter import CACHE_SALT, KV_EVENTS, Observation, TargetTable
from harness.conformance.events import TargetEvent, TargetRemoved, TargetStored

_WHICH_COPY = (
    "with two cached blocks for a prefix, a hit takes the one cached first, evictable or "
    "held; reviving an evictable one costs a free block, so an admission can need a block "
    "more or less than the kit's model (one block per prefix) predicts"
)
FULL_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        "one_block_per_prefix": "a prompt's last full block, recomputed because the last "
        "token is never a hit, is cached again beside the block already caching its "
        "prefix (BlockHashToBlockMap keeps several blocks per hash)",
        "refusal_justified/allocate_prompt": _WHICH_COPY,
        "capacity_respected/allocate_prompt": _WHICH_COPY,
        # docs/findings/vllm-kv-events.md
        "events_stored_twice": "each copy of a prefix (one_block_per_prefix) is stored, so "
        "its hash is stored again while present",
        "events_missing": "evicting one copy of a prefix removes its hash while another "
        "copy stays cached (vLLM #55092's class): a set-of-keys consumer loses the prefix",
    }
)
HYBRID_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        **FULL_DIFFERENCES,
        "refusal_atomic/append_token_ids": "allocate_slots releases the blocks that left "
        "the window before it finds it cannot allocate, and keeps them released (its "
        "comment: 'We can do this even if we cannot schedule this request')",
    }
)

init_none_hash(sha256)


class VLLMAdapter:
    """A real vLLM v1 ``KVCacheManager`` over ``total_blocks`` usable blocks (plus the null one)."""

    exact = False
    supports = frozenset(
        {"allocate_prompt", "append_token_ids", "release", "preempt", CACHE_SALT, KV_EVENTS}
    )

    def __init__(
        self, *, sliding_window: int | None = None, block_size: int = 4, total_blocks: int = 12
    ) -> None:
        def attention(window: int | None) -> Any:  # Any: vLLM's spec classes
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

        self.group_windows: tuple[int | None, ...] = (
            (None,) if sliding_window is None else (None, sliding_window)
        )
        groups = [
            KVCacheGroupSpec([f"layer.{g}"], attention(window))
            for g, window in enumerate(self.group_windows)
        ]
        config = KVCacheConfig(
            num_blocks=total_blocks + 1, kv_cache_tensors=[], kv_cache_groups=groups
        )
        # Any: vLLM objects are the untyped boundary.
        self.manager: Any = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.hasher: Any = get_request_block_hasher(block_size, sha256)
        self.requests: dict[str, Any] = {}
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.name = f"vllm KVCacheManager windows={list(self.group_windows)}"
        self.differences = FULL_DIFFERENCES if sliding_window is None else HYBRID_DIFFERENCES

    @property
    def pool_block_ids(self) -> Sequence[int]:
        return range(1, self.total_blocks + 1)  # block 0 is the null block

    # -- operations -----------------------------------------------------------------------

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        request = Request(
            request_id,
            list(token_ids),
            SamplingParams(max_tokens=1 << 20),
            None,
            cache_salt=cache_salt,
            block_hasher=self.hasher,
        )
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
            raise self._refusal(request_id)
        request.num_computed_tokens = request.num_tokens
        self.requests[request_id] = request
        return int(hit)

    def append_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        request = self.requests[request_id]
        request.append_output_token_ids(list(token_ids))
        if self.manager.allocate_slots(request, len(token_ids)) is None:
            # The scheduler would keep the sampled tokens and preempt another request; the
            # kit's step is atomic, so the tokens are taken back (and the hashes they made).
            del request._output_token_ids[-len(token_ids) :]
            del request._all_token_ids[-len(token_ids) :]
            del request.block_hashes[request.num_tokens // self.block_size :]
            raise self._refusal(request_id)
        request.num_computed_tokens = request.num_tokens

    def release(self, request_id: str) -> None:
        self.manager.free(self.requests.pop(request_id))

    def preempt(self, request_id: str) -> None:
        # As the scheduler's _preempt_request: free the blocks, forget the computed tokens.
        request = self.requests.pop(request_id)
        self.manager.free(request)
        request.num_computed_tokens = 0

    def _refusal(self, request_id: str) -> spec.BlockAllocationError:
        free = int(self.manager.block_pool.get_num_free_blocks())
        return spec.BlockAllocationError.out_of_blocks(request_id, free + 1, free)

    # -- what it shows --------------------------------------------------------------------

    def take_events(self) -> list[TargetEvent]:
        """vLLM's ``take_events()`` (``vllm.distributed.kv_events`` records), neutral."""
        return [_neutral(event) for event in self.manager.take_events()]

    def observe(self) -> Observation:
        pool = self.manager.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        cached: list[set[int]] = [set() for _ in self.group_windows]
        for block in pool.blocks:
            if block.block_hash is not None and not block.is_null:
                cached[get_group_id(block.block_hash)].add(block.block_id)
        tables = []
        ref_counts: dict[int, int] = {}
        for manager in self.manager.coordinator.single_type_managers:
            group_tables = {}
            for request_id, blocks in manager.req_to_blocks.items():
                if not blocks and request_id not in self.requests:
                    continue  # a refused request's empty entry (req_to_blocks is a defaultdict)
                skipped = 0
                while skipped < len(blocks) and blocks[skipped].is_null:
                    skipped += 1
                held = blocks[skipped:]
                for block in held:
                    ref_counts[block.block_id] = block.ref_cnt
                request = self.requests.get(request_id)
                token_count = -1 if request is None else request.num_tokens
                group_tables[request_id] = TargetTable(
                    tuple(block.block_id for block in held), token_count, skipped
                )
            tables.append(group_tables)
        return Observation(
            tables=tuple(tables),
            free_block_ids=tuple(b.block_id for b in free if b.block_hash is None),
            cached_free_block_ids=tuple(b.block_id for b in free if b.block_hash is not None),
            cached_block_ids=tuple(frozenset(ids) for ids in cached),
            ref_counts=ref_counts,
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
