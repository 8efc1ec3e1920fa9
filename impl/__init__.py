"""pagedkv's fast block allocator, with the article series' public API.

``from impl import KVBlockManager, BlockAllocationError`` works as it did there. The table
records are the article's (mutable, a ``list`` of block ids); ``KVBlock``, ``KVBlockUsage``
and the error are the spec's own classes.
"""

from impl.manager import KVBlockManager
from impl.prefix_cache import default_block_hash
from impl.records import AppendedSlots, PromptAllocation, RequestBlockTable, SwapCopies
from spec import (
    BlockAllocationError,
    HostBlockAllocationError,
    KVBlock,
    KVBlockUsage,
    ReleasedBlocks,
    SwappedOut,
)

__all__ = [
    "AppendedSlots",
    "BlockAllocationError",
    "HostBlockAllocationError",
    "KVBlock",
    "KVBlockManager",
    "KVBlockUsage",
    "PromptAllocation",
    "ReleasedBlocks",
    "RequestBlockTable",
    "SwapCopies",
    "SwappedOut",
    "default_block_hash",
]
