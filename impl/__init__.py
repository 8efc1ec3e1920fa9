"""pagedkv's fast block allocator, with the article series' public API.

``from impl import KVBlockManager, BlockAllocationError`` works as it did there. The table
records are the article's (mutable, a ``list`` of block ids); ``KVBlock``, ``KVBlockUsage``
and the error are the spec's own classes.
"""

from impl.manager import KVBlockManager
from impl.prefix_cache import BlockKey, PrefixCache, default_block_hash
from impl.records import PromptAllocation, RequestBlockTable, as_article
from impl.spec_backed import SpecBackedManager
from spec import BlockAllocationError, KVBlock, KVBlockUsage, ReleasedBlocks

__all__ = [
    "BlockAllocationError",
    "BlockKey",
    "KVBlock",
    "KVBlockManager",
    "KVBlockUsage",
    "PrefixCache",
    "PromptAllocation",
    "ReleasedBlocks",
    "RequestBlockTable",
    "SpecBackedManager",
    "as_article",
    "default_block_hash",
]
