"""pagedkv's fast block allocator, with the article series' public API.

``from impl import KVBlockManager, BlockAllocationError`` works as it did there; the
records and the error are the spec's own classes, so spec and impl compare with ``==``.
"""

from impl.manager import KVBlockManager
from spec import BlockAllocationError, KVBlock, KVBlockUsage, RequestBlockTable

__all__ = [
    "BlockAllocationError",
    "KVBlock",
    "KVBlockManager",
    "KVBlockUsage",
    "RequestBlockTable",
]
