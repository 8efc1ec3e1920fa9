"""pagedkv's fast block allocator, with the article series' public API.

``from impl import KVBlockManager, BlockAllocationError`` works as it did there; the
records and the error are the spec's own classes, so spec and impl compare with ``==``.
"""

from impl.block_key import BlockKey, default_block_hash
from impl.manager import KVBlockManager
from spec import (
    BlockAllocationError,
    KVBlock,
    KVBlockUsage,
    PromptAllocation,
    RequestBlockTable,
)

__all__ = [
    "BlockAllocationError",
    "BlockKey",
    "KVBlock",
    "KVBlockManager",
    "KVBlockUsage",
    "PromptAllocation",
    "RequestBlockTable",
    "default_block_hash",
]
