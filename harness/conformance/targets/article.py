"""An article-style block manager, as the series' first chapter builds one, as an exact target.

A free list, one table per request, allocate by count, grow by count, release: no prefix
cache, no sharing, no windows. Its order is the spec's (the free list is a queue; released
blocks join its tail, last block first), so the kit checks it in exact mode. It is also the
smallest example of an adapter: the manager and its adapter are one class.
"""

from collections import deque
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import spec
from harness.conformance.adapter import Observation, TargetTable


class ArticleBlockManager:
    """A pool of ``total_blocks`` blocks of ``block_size`` tokens lent to requests by count."""

    exact = True
    supports = frozenset({"allocate", "append_tokens", "release", "preempt"})
    differences: Mapping[str, str] = MappingProxyType({})
    group_windows: tuple[int | None, ...] = (None,)

    def __init__(self, total_blocks: int = 12, block_size: int = 4) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(total_blocks))
        self.tables: dict[str, list[int]] = {}
        self.token_counts: dict[str, int] = {}
        self.name = type(self).__name__

    @property
    def pool_block_ids(self) -> Sequence[int]:
        return range(self.total_blocks)

    def allocate(self, request_id: str, token_count: int) -> None:
        self.tables[request_id] = self._take(request_id, self._blocks_for(token_count))
        self.token_counts[request_id] = token_count

    def append_tokens(self, request_id: str, token_count: int) -> None:
        new_count = self.token_counts[request_id] + token_count
        needed = self._blocks_for(new_count) - len(self.tables[request_id])
        self.tables[request_id] += self._take(request_id, needed)
        self.token_counts[request_id] = new_count

    def release(self, request_id: str) -> None:
        self.free.extend(reversed(self.tables.pop(request_id)))
        del self.token_counts[request_id]

    def preempt(self, request_id: str) -> None:
        self.release(request_id)

    def observe(self) -> Observation:
        return Observation(
            tables=(
                {
                    request_id: TargetTable(tuple(block_ids), self.token_counts[request_id])
                    for request_id, block_ids in self.tables.items()
                },
            ),
            free_block_ids=tuple(self.free),
        )

    def _blocks_for(self, token_count: int) -> int:
        return spec.blocks_for_tokens(self.block_size, token_count)

    def _take(self, request_id: str, count: int) -> list[int]:
        if count > len(self.free):
            raise spec.BlockAllocationError.out_of_blocks(request_id, count, len(self.free))
        return [self.free.popleft() for _ in range(count)]
