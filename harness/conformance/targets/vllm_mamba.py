"""vLLM v1's scheduler over a hybrid model's ``KVCacheManager``: a full-attention group and a
Mamba group in align mode, as a conformance target (refinement mode).

The real ``Scheduler`` as ``harness.conformance.targets.vllm_engine`` drives it, over a
``KVCacheConfig`` of a ``FullAttentionSpec`` group and a ``MambaSpec`` group
(``mamba_cache_mode="align"``, the mode prefix caching selects for a hybrid model), with
``CacheConfig.mamba_cache_mode = "align"`` so that the scheduler cuts prefill chunks on the
block grid (``_mamba_block_aligned_split``) and a token budget of ``TOKEN_BUDGET`` a step,
so that long prefills are chunked and leave checkpoints before their last one. The
scheduler calls ``new_step_starts()`` itself each step. Retention is stated:
``prefix_cache_retention_interval = block_size``, one state kept per block (vLLM's dense
retention): every grid point a chunk ends on keeps its state, the spec's rule.

The oracle is the spec with ``group_windows = (None, RecurrentState(block_size))``: vLLM's
``mamba_block_size`` is the block size in align mode, so its checkpoint grid is the
spec's interval C. vLLM's Mamba table is position-indexed over the whole sequence: block p
is the state after (p + 1) * block_size tokens, null blocks stand anywhere for positions
with no state (not only leading ones), and beside its running block (the last) a request
keeps earlier ones while the worker copies the state from them (``preprocess_mamba``
copies the block before the running one into it: a prefix hit's checkpoint, or the
previous running block). The adapter
shows the spec's shape: the running block as the group's one-block table, the earlier
blocks as copy sources in flight, and the copy into the running block from the block
before it as a pending copy, so the spec's state hit rule (``state_hit_exact``) reads
which checkpoint a hit restores. The kit learns which state a block holds from its
request's tokens (``harness.conformance.view.Contents``), not from the block's position,
which is what vLLM's hash is computed from: a state cached at the wrong position shows
as the wrong state restored. vLLM frees a spent copy source in the request's next
``allocate_slots`` (``MambaManager.remove_skipped_blocks``, run first), reported as a
call of its own, ``take_copies(r)``.

Where vLLM's rules differ from the spec's by design, ``vllm_differences.MAMBA_DIFFERENCES``
says why (docs/conformance.md, "vLLM's hybrid manager").
"""

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import MambaSpec

import spec
from harness.conformance.adapter import (
    CACHE_SALT,
    DEFERRED,
    WHOLE_PROMPT,
    Call,
    Outcome,
    TargetTable,
)
from harness.conformance.targets.vllm_differences import FINDINGS, MAMBA_DIFFERENCES
from harness.conformance.targets.vllm_engine import (
    ShownTable,
    VLLMEngine,
    _attention,
    vllm_config,
)

# Tokens the scheduler schedules a step: a prompt longer than this is prefilled in chunks.
TOKEN_BUDGET = 8


class VLLMMambaEngine(VLLMEngine):
    """The real vLLM v1 ``Scheduler`` over a full-attention group and a Mamba group (align
    mode) sharing ``total_blocks`` usable blocks (plus the null one)."""

    # Not KV_EVENTS: a Mamba group's BlockStored names only its non-null blocks' hashes
    # but carries every token of the range, so the kit's consumer (one hash per
    # block_size tokens) cannot read it (docs/conformance.md, "vLLM's hybrid manager").
    supports = frozenset({CACHE_SALT})

    def __init__(
        self,
        *,
        block_size: int = 4,
        total_blocks: int = 16,
        known_findings: bool = False,
        retention_interval: int | None = None,
    ) -> None:
        """``retention_interval``: vLLM's ``prefix_cache_retention_interval``; by default
        the block size (one state kept per block, the spec's rule)."""
        mamba = MambaSpec(
            block_size=block_size,
            shapes=((2, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode="align",
        )
        self._start(
            group_windows=(None, spec.RecurrentState(block_size)),
            specs=[_attention(block_size, None), mamba],
            config=vllm_config(block_size, total_blocks, TOKEN_BUDGET, mamba_align=True),
            differences={**MAMBA_DIFFERENCES, **(FINDINGS if known_findings else {})},
            name=f"vllm Scheduler full + mamba(align, C={block_size})",
            retention_interval=block_size if retention_interval is None else retention_interval,
        )
        self.mamba: Any = self.manager.coordinator.single_type_managers[1]
        self._watch_copy_sources()
        self._watch_admission_gate()

    def _watch_admission_gate(self) -> None:
        """Note the blocks the last whole-prompt admission check counted (vLLM's
        ``full_sequence_must_fit``: the coordinator's count with ``apply_admission_cap``)."""
        coordinator = self.manager.coordinator
        count = coordinator.get_num_blocks_to_allocate
        self._gate: tuple[int, int] | None = None

        def watched(*args: Any, **kwargs: Any) -> int:
            needed = int(count(*args, **kwargs))
            gated = kwargs.get("apply_admission_cap", False)
            free = self.manager.block_pool.get_num_free_blocks()
            self._gate = (needed, free) if gated else None
            return needed

        coordinator.get_num_blocks_to_allocate = watched

    def _watch_copy_sources(self) -> None:
        """Report the Mamba manager's ``remove_skipped_blocks``, which a request's
        ``allocate_slots`` runs first and which frees the blocks its state copies read
        (the last forward made them), as ``take_copies(r)``: a call of its own, before
        the allocation it is part of."""
        remove_skipped_blocks = self.mamba.remove_skipped_blocks

        def watched(request_id: str, *args: Any, **kwargs: Any) -> None:
            before = self.observe()
            remove_skipped_blocks(request_id, *args, **kwargs)
            after = self.observe()
            if after != before:
                self.calls.append(Call("take_copies", (request_id,), Outcome(), before, after))
                self._landed = after

        self.mamba.remove_skipped_blocks = watched

    def _table(self, group: int, blocks: Sequence[Any], token_count: int) -> ShownTable:
        """A Mamba table (position-indexed, null blocks anywhere) as the spec sees it: the
        running block (the last non-null one) as the one-block table, the blocks before it as
        copy sources in flight, the one just before it copied into it."""
        if group == 0:
            return super()._table(group, blocks, token_count)
        held = [block.block_id for block in blocks if not block.is_null]
        if not held:
            return ShownTable(TargetTable((), token_count))
        running, sources = held[-1], tuple(held[:-1])
        copies = ((sources[-1], running),) if sources else ()
        return ShownTable(TargetTable((running,), token_count), sources, copies)

    def _refusal(self, admitting: bool, hit_blocks: Any) -> str:  # Any: KVCacheBlocks
        """A deferred admission (a hit on a Mamba checkpoint cached in this step) is tagged
        ``DEFERRED``, one refused by the whole-prompt gate ``WHOLE_PROMPT``; any other
        refusal is a capacity refusal."""
        if admitting and hit_blocks is not None:
            mamba_hit = hit_blocks.blocks[1]
            if mamba_hit and mamba_hit[-1].block_hash in self.mamba.cached_blocks_this_step:
                return f"{DEFERRED}: its Mamba checkpoint was cached in this step"
        if admitting and self._gate is not None:
            needed, free = self._gate
            return f"{WHOLE_PROMPT}: its whole prompt needs {needed} blocks, {free} free"
        return super()._refusal(admitting, hit_blocks)
