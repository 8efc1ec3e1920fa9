"""pagedkv's executable specification: frozen allocator states and pure operations.

Standard library only. Not necessarily optimal: it is the definition of correct, and
impl/ is tested against it.
"""

from spec.allocator import (
    AllocatorState,
    SharingCounters,
    allocate,
    allocate_prompt,
    append_token_ids,
    append_tokens,
    blocks_for_tokens,
    cached_prefix_blocks,
    fork,
    free_blocks,
    init,
    preempt,
    release,
    slot_index,
    snapshot_request,
    take_copies,
    truncate,
    usage,
)
from spec.errors import (
    MAX_BLOCK_SIZE,
    MAX_TOKEN_ID,
    MAX_TOTAL_BLOCKS,
    BlockAllocationError,
    check_pool_shape,
    check_request_id,
    check_token_count,
    check_token_ids,
    duplicate_request,
    unknown_request,
)
from spec.frozen_map import FrozenMap
from spec.invariants import INVARIANTS, is_usage_consistent, violated_invariants
from spec.records import (
    KVBlock,
    KVBlockUsage,
    PromptAllocation,
    ReleasedBlocks,
    RequestBlockTable,
)

__all__ = [
    "INVARIANTS",
    "MAX_BLOCK_SIZE",
    "MAX_TOKEN_ID",
    "MAX_TOTAL_BLOCKS",
    "AllocatorState",
    "BlockAllocationError",
    "FrozenMap",
    "KVBlock",
    "KVBlockUsage",
    "PromptAllocation",
    "ReleasedBlocks",
    "RequestBlockTable",
    "SharingCounters",
    "allocate",
    "allocate_prompt",
    "append_token_ids",
    "append_tokens",
    "blocks_for_tokens",
    "cached_prefix_blocks",
    "check_pool_shape",
    "check_request_id",
    "check_token_count",
    "check_token_ids",
    "duplicate_request",
    "fork",
    "free_blocks",
    "init",
    "is_usage_consistent",
    "preempt",
    "release",
    "slot_index",
    "snapshot_request",
    "take_copies",
    "truncate",
    "unknown_request",
    "usage",
    "violated_invariants",
]
