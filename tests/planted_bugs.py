"""Deliberately broken allocators: each must make the state machine fail.

They prove the checks can fail. Each is the smallest change to ``KVBlockManager`` that
plants one kind of bug met in real allocators.
"""

from impl import BlockAllocationError, KVBlockManager, RequestBlockTable
from impl.manager import _Table


class ReleasesInTableOrder(KVBlockManager):
    """(a) Frees blocks first-block-first, against the specified last-block-first order."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        table = self._tables.pop(request_id)
        self._free.extend(table.block_ids)
        self._allocated_tokens -= table.token_count
        return list(table.block_ids)


class LeaksOneBlockOnRelease(KVBlockManager):
    """(b) Forgets to return a request's last block to the free queue."""

    __slots__ = ()

    def release(self, request_id: str) -> list[int]:
        table = self._tables.pop(request_id)
        self._free.extend(reversed(table.block_ids[:-1]))
        self._allocated_tokens -= table.token_count
        return list(table.block_ids)


class RefusedAllocateTakesBlocks(KVBlockManager):
    """(c) Takes blocks before checking there are enough, and keeps them when it refuses."""

    __slots__ = ()

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        needed = self._blocks_for(token_count)
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already allocated")
        taken = [self._free.popleft() for _ in range(min(needed, len(self._free)))]
        if len(taken) < needed:
            raise BlockAllocationError(request_id, needed, len(taken))
        self._tables[request_id] = _Table(taken, token_count)
        self._allocated_tokens += token_count
        return RequestBlockTable(request_id, tuple(taken), token_count)


class OffByOneAtBlockBoundary(KVBlockManager):
    """(d) Sizes tables as token_count // block_size + 1: one block too many on a boundary."""

    __slots__ = ()

    def _blocks_for(self, token_count: int) -> int:
        if token_count < 0:
            raise ValueError(f"token_count must be >= 0, got {token_count}")
        return token_count // self.block_size + 1


class DecodeSlotFromStaleBlock(KVBlockManager):
    """(e) The hot decode path computes the slot from the block it had before opening a new one."""

    __slots__ = ()

    def append_slot(self, request_id: str) -> int:
        table = self._tables[request_id]
        offset = table.token_count % self.block_size
        stale = table.block_ids[-1] * self.block_size + offset if table.block_ids else None
        slot = super().append_slot(request_id)
        return slot if stale is None else stale


PLANTED_BUGS: list[type[KVBlockManager]] = [
    ReleasesInTableOrder,
    LeaksOneBlockOnRelease,
    RefusedAllocateTakesBlocks,
    OffByOneAtBlockBoundary,
    DecodeSlotFromStaleBlock,
]
