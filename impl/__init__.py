"""pagedkv's fast block allocator.

``KVCacheManager`` is the allocator an engine drives, one method per row of
``spec.api.OPERATIONS``; ``KVBlockManager`` is the article series' API over it, so
``from impl import KVBlockManager, BlockAllocationError`` works as it did there. The
article's table record is mutable (a ``list`` of block ids); ``AppendedSlots`` is a named
tuple built fast; every other record and the errors are the spec's own classes.
"""

from impl.article import KVBlockManager
from impl.manager import KVCacheManager
from impl.prefix_cache import default_block_hash
from impl.records import AppendedSlots, RequestBlockTable
from spec import (
    BlockAllocationError,
    HostBlockAllocationError,
    KVBlock,
    KVBlockUsage,
    ReleasedBlocks,
    Transfers,
)

__all__ = [
    "AppendedSlots",
    "BlockAllocationError",
    "HostBlockAllocationError",
    "KVBlock",
    "KVBlockManager",
    "KVBlockUsage",
    "KVCacheManager",
    "ReleasedBlocks",
    "RequestBlockTable",
    "Transfers",
    "default_block_hash",
]
