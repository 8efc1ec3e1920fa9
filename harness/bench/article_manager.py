"""The article-style baseline manager the allocator benchmark times beside impl, and the
allocator calls the benchmark's scheduler makes (``Allocator``): the ones the article's
manager, impl's ``KVBlockManager`` over it and impl's ``KVCacheManager`` all have.

NOTE: the baseline restates the article's own arithmetic (``math.ceil`` and ``//`` slot
maths) on purpose: it is what impl is measured against, so it does not use spec's rules.
"""

import math
from collections import deque
from typing import Protocol

from impl import BlockAllocationError, KVBlockUsage, RequestBlockTable


class Allocator(Protocol):
    """The allocator calls a scheduler makes, as every manager spells them; a decode step's
    append is named by the caller (``append_slot``, ``append_tokens``, ``append``)."""

    @property
    def total_blocks(self) -> int: ...
    def allocate(self, request_id: str, token_count: int) -> object: ...
    def release(self, request_id: str) -> object: ...
    def usage(self) -> KVBlockUsage: ...


class ArticleStyleManager:
    """A baseline that behaves as the article series' manager does, written here to time
    it beside impl in one run: list tables, a deque free list, every call returning a
    copied snapshot, release in table order, no ref counts and no prefix cache."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(total_blocks))
        self.request_tables: dict[str, RequestBlockTable] = {}

    @property
    def free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> KVBlockUsage:
        used = self.total_blocks - len(self.free_block_ids)
        return KVBlockUsage(
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            used_blocks=used,
            free_blocks=len(self.free_block_ids),
            request_count=len(self.request_tables),
            allocated_tokens=sum(t.token_count for t in self.request_tables.values()),
            reserved_tokens=used * self.block_size,
        )

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        if request_id in self.request_tables:
            raise ValueError(f"request already has allocated blocks: {request_id}")
        needed = math.ceil(token_count / self.block_size)
        self._ensure_free(needed)
        taken = [self.free_block_ids.popleft() for _ in range(needed)]
        self.request_tables[request_id] = RequestBlockTable(request_id, taken, token_count)
        return self._snapshot(request_id)

    def append_slot(self, request_id: str) -> int:
        table = self.append_tokens(request_id, 1)
        position = table.token_count - 1
        return table.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        if request_id not in self.request_tables:
            raise KeyError(f"request has no allocated blocks: {request_id}")
        table = self.request_tables[request_id]
        new_count = table.token_count + token_count
        more = math.ceil(new_count / self.block_size) - math.ceil(
            table.token_count / self.block_size
        )
        self._ensure_free(more)
        table.block_ids.extend(self.free_block_ids.popleft() for _ in range(more))
        table.token_count = new_count
        return self._snapshot(request_id)

    def release(self, request_id: str) -> list[int]:
        table = self.request_tables.pop(request_id, None)
        if table is None:
            raise KeyError(f"request has no allocated blocks: {request_id}")
        released = list(table.block_ids)
        self.free_block_ids.extend(released)
        return released

    def _snapshot(self, request_id: str) -> RequestBlockTable:
        table = self.request_tables[request_id]
        return RequestBlockTable(request_id, list(table.block_ids), table.token_count)

    def _ensure_free(self, count: int) -> None:
        if count > len(self.free_block_ids):
            raise BlockAllocationError(
                f"not enough free KV blocks: needed={count} free={len(self.free_block_ids)}"
            )
