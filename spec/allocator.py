"""The executable specification of the paged KV block allocator.

Frozen data and pure functions: every operation takes a state and returns a new one,
never touching its argument. This is the definition of correct behaviour, written to be
read, not to be fast (impl/ is the fast one).

Block order is part of the contract, so that impl can be compared with it exactly:
- ``init`` lays the free queue out as 0, 1, ..., total_blocks - 1;
- allocation takes blocks from the head of the free queue, in queue order;
- ``release`` appends a request's blocks to the tail of the free queue last block
  first, so the head of a request's table is the last of its blocks to be reused.

Errors (checked in this order, and a refused operation changes nothing):
``ValueError`` for bad configuration, a negative token count or a duplicate request id;
``KeyError`` for an unknown request id; ``BlockAllocationError`` when the free queue
holds fewer blocks than the operation needs.
"""

from dataclasses import dataclass, replace

from spec.errors import BlockAllocationError
from spec.frozen_map import FrozenMap
from spec.records import KVBlockUsage, RequestBlockTable


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """The whole allocator: pool shape, the free queue (head first) and every request's table."""

    block_size: int
    total_blocks: int
    free_block_ids: tuple[int, ...]
    tables: FrozenMap[str, RequestBlockTable]


def blocks_for_tokens(block_size: int, token_count: int) -> int:
    """The number of blocks that ``token_count`` tokens occupy: ceil(token_count / block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if token_count < 0:
        raise ValueError(f"token_count must be >= 0, got {token_count}")
    return -(-token_count // block_size)


def slot_index(block_size: int, block_ids: tuple[int, ...], position: int) -> int:
    """Where token ``position`` of a request lives in the pool: block_id * block_size + offset."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return block_ids[position // block_size] * block_size + position % block_size


def init(total_blocks: int, block_size: int) -> AllocatorState:
    """An empty pool of ``total_blocks`` blocks of ``block_size`` tokens, all free, in id order."""
    if total_blocks < 1:
        raise ValueError(f"total_blocks must be >= 1, got {total_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return AllocatorState(
        block_size=block_size,
        total_blocks=total_blocks,
        free_block_ids=tuple(range(total_blocks)),
        tables=FrozenMap(),
    )


def block_table(state: AllocatorState, request_id: str) -> RequestBlockTable:
    """The table of ``request_id``; ``KeyError`` if it holds no blocks here."""
    return state.tables[request_id]


def allocate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Give a new request the blocks for ``token_count`` tokens, from the free queue's head."""
    needed = blocks_for_tokens(state.block_size, token_count)
    if request_id in state.tables:
        raise ValueError(f"request {request_id!r} is already allocated")
    if needed > len(state.free_block_ids):
        raise BlockAllocationError(request_id, needed, len(state.free_block_ids))
    table = RequestBlockTable(request_id, state.free_block_ids[:needed], token_count)
    return replace(
        state,
        free_block_ids=state.free_block_ids[needed:],
        tables=state.tables.set(request_id, table),
    )


def append_tokens(state: AllocatorState, request_id: str, token_count: int = 1) -> AllocatorState:
    """Grow a request by ``token_count`` tokens, taking blocks from the free queue's head."""
    if token_count < 0:
        raise ValueError(f"token_count must be >= 0, got {token_count}")
    table = state.tables[request_id]
    new_token_count = table.token_count + token_count
    needed = blocks_for_tokens(state.block_size, new_token_count) - len(table.block_ids)
    if needed > len(state.free_block_ids):
        raise BlockAllocationError(request_id, needed, len(state.free_block_ids))
    grown = RequestBlockTable(
        request_id, table.block_ids + state.free_block_ids[:needed], new_token_count
    )
    return replace(
        state,
        free_block_ids=state.free_block_ids[needed:],
        tables=state.tables.set(request_id, grown),
    )


def release(state: AllocatorState, request_id: str) -> AllocatorState:
    """Drop a request: its blocks join the free queue's tail, last block first.

    The ids released, in table order, are ``block_table(state, request_id).block_ids``.
    """
    table = state.tables[request_id]
    return replace(
        state,
        free_block_ids=state.free_block_ids + tuple(reversed(table.block_ids)),
        tables=state.tables.delete(request_id),
    )


def usage(state: AllocatorState) -> KVBlockUsage:
    """The usage report, computed from the tables."""
    used_blocks = sum(len(table.block_ids) for table in state.tables.values())
    return KVBlockUsage(
        block_size=state.block_size,
        total_blocks=state.total_blocks,
        used_blocks=used_blocks,
        free_blocks=len(state.free_block_ids),
        request_count=len(state.tables),
        allocated_tokens=sum(table.token_count for table in state.tables.values()),
        reserved_tokens=used_blocks * state.block_size,
    )
