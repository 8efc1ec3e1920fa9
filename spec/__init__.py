"""pagedkv's executable specification: frozen allocator states and pure operations.

Standard library only. Not necessarily optimal: it is the definition of correct, and
impl/ is tested against it.
"""

from spec.allocator import (
    AllocatorState,
    allocate,
    append_tokens,
    block_table,
    blocks_for_tokens,
    init,
    release,
    slot_index,
    usage,
)
from spec.errors import BlockAllocationError
from spec.frozen_map import FrozenMap
from spec.invariants import INVARIANTS, is_usage_consistent, violated_invariants
from spec.records import KVBlock, KVBlockUsage, RequestBlockTable

__all__ = [
    "INVARIANTS",
    "AllocatorState",
    "BlockAllocationError",
    "FrozenMap",
    "KVBlock",
    "KVBlockUsage",
    "RequestBlockTable",
    "allocate",
    "append_tokens",
    "block_table",
    "blocks_for_tokens",
    "init",
    "is_usage_consistent",
    "release",
    "slot_index",
    "usage",
    "violated_invariants",
]
