"""The executable specification of the paged KV block allocator, with sharing.

Frozen data and pure functions: every operation takes a state and returns a new one,
never touching its argument. This is the definition of correct behaviour, written to be
read, not to be fast (impl/ is the fast one and is tested against this module).

Block order is part of the contract, so that impl can be compared with it exactly:
- ``init`` lays the free queue out as 0, 1, ..., total_blocks - 1;
- a block an operation needs comes from the head of the free queue; only when that is
  empty does it come from the head of the cached free queue (least recently freed first),
  and its cached prefix is evicted;
- ``release`` drops one reference from each of a request's blocks, last block first; a
  block left with none goes to the tail of the cached free queue if it holds a cached
  prefix, else to the tail of the free queue.

Sharing. A block may sit in several tables: a full block whose tokens are a prefix that
two prompts share (prefix caching), or any block after ``fork``. ``ref_counts`` counts the
tables holding each block. The prefix cache maps a prompt prefix that ends on a block
boundary to the block holding its last ``block_size`` tokens. Keys are whole prefixes, so
a hit is confirmed by comparing token ids, never a hash. Appending into a shared, partly
filled last block copies it first (copy-on-write): the writer gets a fresh block and the
(source, destination) pair joins ``pending_copies`` for the KV pool to perform.

Errors (``spec.errors``; checked in the order each operation lists; a refused operation
changes nothing): ``TypeError`` for an argument of the wrong type; ``ValueError`` for bad
configuration, a negative count, a token id out of range, a duplicate request id or the
wrong kind of append; ``KeyError`` for an unknown request id; ``BlockAllocationError`` when
the free and cached free queues together hold fewer blocks than the operation needs.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from spec.errors import (
    BlockAllocationError,
    check_pool_shape,
    check_request_id,
    check_token_count,
    check_token_ids,
    duplicate_request,
    unknown_request,
)
from spec.frozen_map import FrozenMap
from spec.records import KVBlockUsage, RequestBlockTable

TokenIds = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SharingCounters:
    """Running totals of the sharing machinery, for the usage report."""

    prefix_hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """The whole allocator: pool shape, both free queues, tables, references and the cache."""

    block_size: int
    total_blocks: int
    free_block_ids: tuple[int, ...]
    tables: FrozenMap[str, RequestBlockTable]
    cached_free_block_ids: tuple[int, ...]
    ref_counts: FrozenMap[int, int]
    token_ids: FrozenMap[str, TokenIds]
    cache: FrozenMap[TokenIds, int]
    pending_copies: tuple[tuple[int, int], ...]
    counters: SharingCounters


def blocks_for_tokens(block_size: int, token_count: int) -> int:
    """The number of blocks that ``token_count`` tokens occupy: ceil(token_count / block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    check_token_count(token_count)
    return -(-token_count // block_size)


def slot_index(block_size: int, block_ids: Sequence[int], position: int) -> int:
    """Where token ``position`` of a request lives in the pool: block_id * block_size + offset."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return block_ids[position // block_size] * block_size + position % block_size


def init(total_blocks: int, block_size: int) -> AllocatorState:
    """An empty pool of ``total_blocks`` blocks of ``block_size`` tokens, all free, in id order.

    Checks: both sizes ``int`` (TypeError), in [1, MAX_TOTAL_BLOCKS] and [1, MAX_BLOCK_SIZE]
    (ValueError).
    """
    check_pool_shape(total_blocks, block_size)
    return AllocatorState(
        block_size=block_size,
        total_blocks=total_blocks,
        free_block_ids=tuple(range(total_blocks)),
        tables=FrozenMap(),
        cached_free_block_ids=(),
        ref_counts=FrozenMap(),
        token_ids=FrozenMap(),
        cache=FrozenMap(),
        pending_copies=(),
        counters=SharingCounters(),
    )


# -- queries ----------------------------------------------------------------------------


def snapshot_request(state: AllocatorState, request_id: str) -> RequestBlockTable:
    """The table of ``request_id``; ``KeyError`` if it holds no blocks here."""
    table = state.tables.get(request_id)
    if table is None:
        unknown_request(request_id)
    return table


def free_blocks(state: AllocatorState) -> int:
    """Blocks an allocation may take: the free queue plus the cached free queue."""
    return len(state.free_block_ids) + len(state.cached_free_block_ids)


def cached_prefix_blocks(state: AllocatorState, token_ids: TokenIds) -> tuple[int, ...]:
    """The longest run of cached blocks that holds a prefix of ``token_ids``.

    It never covers the last token, so that at least one token of a prompt is computed.
    """
    block_size = state.block_size
    hits: list[int] = []
    while (len(hits) + 1) * block_size <= len(token_ids) - 1:
        block_id = state.cache.get(token_ids[: (len(hits) + 1) * block_size])
        if block_id is None:
            break
        hits.append(block_id)
    return tuple(hits)


def usage(state: AllocatorState) -> KVBlockUsage:
    """The usage report, computed from the tables, the queues and the cache."""
    free = free_blocks(state)
    used_blocks = state.total_blocks - free
    return KVBlockUsage(
        block_size=state.block_size,
        total_blocks=state.total_blocks,
        used_blocks=used_blocks,
        free_blocks=free,
        request_count=len(state.tables),
        allocated_tokens=sum(table.token_count for table in state.tables.values()),
        reserved_tokens=used_blocks * state.block_size,
        cached_blocks=len(state.cache),
        shared_blocks=sum(1 for count in state.ref_counts.values() if count > 1),
        prefix_hit_tokens=state.counters.prefix_hit_tokens,
        evictions=state.counters.evictions,
        cow_copies=state.counters.cow_copies,
        preemptions=state.counters.preemptions,
    )


# -- transitions --------------------------------------------------------------------------


def allocate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Give a new request blocks for ``token_count`` tokens whose ids are not tracked.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a ``str`` request id
    (TypeError) that is new (ValueError), enough blocks (BlockAllocationError). Its blocks
    are never cached.
    """
    needed = blocks_for_tokens(state.block_size, token_count)
    check_request_id(request_id)
    if request_id in state.tables:
        duplicate_request(request_id)
    if needed > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, needed, free_blocks(state))
    state, taken = _take_blocks(state, needed)
    table = RequestBlockTable(request_id, taken, token_count)
    return replace(state, tables=state.tables.set(request_id, table))


def allocate_prompt(state: AllocatorState, request_id: str, token_ids: TokenIds) -> AllocatorState:
    """Give a new request blocks for its prompt, reusing the longest cached prefix.

    Checks: a ``str`` request id (TypeError) that is new (ValueError), token ids that are
    ``int`` (TypeError) in [0, MAX_TOKEN_ID] (ValueError), enough blocks beyond the cache
    hits (BlockAllocationError). Hit blocks gain a reference (a cached free block is revived);
    the rest come from the queues; every block the prompt fills becomes cached. The hits
    are ``cached_prefix_blocks(state, token_ids)`` of the state before.
    """
    check_request_id(request_id)
    if request_id in state.tables:
        duplicate_request(request_id)
    check_token_ids(token_ids)
    hits = cached_prefix_blocks(state, token_ids)
    needed = blocks_for_tokens(state.block_size, len(token_ids)) - len(hits)
    revived = [block_id for block_id in hits if block_id in state.cached_free_block_ids]
    available = free_blocks(state) - len(revived)
    if needed > available:
        raise BlockAllocationError.out_of_blocks(request_id, needed, available)
    state = replace(
        state,
        cached_free_block_ids=tuple(
            block_id for block_id in state.cached_free_block_ids if block_id not in revived
        ),
        ref_counts=_add_references(state.ref_counts, hits),
        counters=replace(
            state.counters,
            prefix_hit_tokens=state.counters.prefix_hit_tokens + len(hits) * state.block_size,
        ),
    )
    state, taken = _take_blocks(state, needed)
    table = RequestBlockTable(request_id, hits + taken, len(token_ids))
    state = replace(
        state,
        tables=state.tables.set(request_id, table),
        token_ids=state.token_ids.set(request_id, tuple(token_ids)),
    )
    return _cache_full_blocks(state, request_id, first_index=len(hits))


def append_tokens(state: AllocatorState, request_id: str, token_count: int = 1) -> AllocatorState:
    """Grow a request allocated by count by ``token_count`` tokens, taking blocks as needed.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a known request
    (KeyError), a request allocated by count, not by token ids (ValueError), enough blocks
    (BlockAllocationError).
    """
    check_token_count(token_count)
    snapshot_request(state, request_id)
    if request_id in state.token_ids:
        raise ValueError(f"request {request_id!r} tracks token ids: use append_token_ids")
    return _grow(state, request_id, token_count)


def append_token_ids(state: AllocatorState, request_id: str, token_ids: TokenIds) -> AllocatorState:
    """Grow a request allocated by ``allocate_prompt`` by these tokens; full blocks get cached.

    Checks: a known request (KeyError), a request that tracks token ids (ValueError), token
    ids that are ``int`` (TypeError) in [0, MAX_TOKEN_ID] (ValueError), enough blocks
    (BlockAllocationError).
    """
    snapshot_request(state, request_id)
    if request_id not in state.token_ids:
        raise ValueError(f"request {request_id!r} was allocated by count: use append_tokens")
    check_token_ids(token_ids)
    state = _grow(state, request_id, len(token_ids))
    old_ids = state.token_ids[request_id]
    state = replace(state, token_ids=state.token_ids.set(request_id, old_ids + tuple(token_ids)))
    return _cache_full_blocks(state, request_id, first_index=len(old_ids) // state.block_size)


def fork(state: AllocatorState, parent_id: str, child_id: str) -> AllocatorState:
    """Give ``child_id`` a table sharing every block of ``parent_id`` (one more reference each).

    Checks: a known parent (KeyError), a ``str`` child id (TypeError) that is new
    (ValueError). Takes no block.
    """
    parent = snapshot_request(state, parent_id)
    check_request_id(child_id)
    if child_id in state.tables:
        duplicate_request(child_id)
    child = RequestBlockTable(child_id, parent.block_ids, parent.token_count)
    token_ids = state.token_ids
    if parent_id in token_ids:
        token_ids = token_ids.set(child_id, token_ids[parent_id])
    return replace(
        state,
        tables=state.tables.set(child_id, child),
        token_ids=token_ids,
        ref_counts=_add_references(state.ref_counts, parent.block_ids),
    )


def release(state: AllocatorState, request_id: str) -> AllocatorState:
    """Drop a request: each of its blocks loses a reference, last block first.

    Checks: a known request (KeyError). A block left with no reference joins the tail of the
    cached free queue if it holds a cached prefix (it stays findable), else of the free
    queue; a pending copy into it is dropped. The ids released, in table order, are
    ``snapshot_request(state, request_id).block_ids``.
    """
    table = snapshot_request(state, request_id)
    state = _drop_references(state, table.block_ids)
    token_ids = state.token_ids
    if request_id in token_ids:
        token_ids = token_ids.delete(request_id)
    return replace(state, tables=state.tables.delete(request_id), token_ids=token_ids)


def truncate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Shrink a request to its first ``token_count`` tokens: the rollback of rejected
    speculative tokens.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a known request
    (KeyError), ``token_count`` at most the request's tokens (ValueError). The blocks wholly
    beyond the new length are dropped as ``release`` drops a table's blocks (last first, to
    the tails of the queues). If the new last block is partly filled and was a cached full
    block, it stops being cached, whoever holds it: its slots past the new length will be
    written again (in place, or in a copy if it is shared: the next append copies a shared
    partly filled block). Tokens past the new length are forgotten.
    """
    check_token_count(token_count)
    table = snapshot_request(state, request_id)
    if token_count > table.token_count:
        raise ValueError(
            f"cannot truncate request {request_id!r} to {token_count} tokens: "
            f"it holds {table.token_count}"
        )
    keep = blocks_for_tokens(state.block_size, token_count)
    state = _drop_references(state, table.block_ids[keep:])
    kept = table.block_ids[:keep]
    cache = state.cache
    if token_count % state.block_size and kept[-1] in cache.values():
        cache = FrozenMap({key: b for key, b in cache.items() if b != kept[-1]})
    token_ids = state.token_ids
    if request_id in token_ids:
        token_ids = token_ids.set(request_id, token_ids[request_id][:token_count])
    shrunk = RequestBlockTable(request_id, kept, token_count)
    return replace(
        state, tables=state.tables.set(request_id, shrunk), token_ids=token_ids, cache=cache
    )


def preempt(state: AllocatorState, request_id: str) -> AllocatorState:
    """Release a request the engine preempts to recompute later; counts the preemption."""
    state = release(state, request_id)
    counters = replace(state.counters, preemptions=state.counters.preemptions + 1)
    return replace(state, counters=counters)


def take_copies(state: AllocatorState) -> AllocatorState:
    """Clear ``pending_copies`` once the KV pool has performed them (they are read before)."""
    return replace(state, pending_copies=())


# -- building blocks ----------------------------------------------------------------------


def _add_references(
    ref_counts: FrozenMap[int, int], block_ids: tuple[int, ...]
) -> FrozenMap[int, int]:
    counts = dict(ref_counts)
    for block_id in block_ids:
        counts[block_id] = counts.get(block_id, 0) + 1
    return FrozenMap(counts)


def _drop_references(state: AllocatorState, block_ids: tuple[int, ...]) -> AllocatorState:
    """Drop one reference from each of ``block_ids``, last first; a block left with none
    joins the tail of the cached free queue if it holds a cached prefix, else of the free
    queue. A pending copy into a block that became free is moot and is dropped, so a
    pending copy never writes into a block that is free or lent to another request."""
    cached = set(state.cache.values())
    ref_counts = dict(state.ref_counts)
    freed: list[int] = []
    freed_cached: list[int] = []
    for block_id in reversed(block_ids):
        ref_counts[block_id] -= 1
        if ref_counts[block_id] == 0:
            del ref_counts[block_id]
            (freed_cached if block_id in cached else freed).append(block_id)
    return replace(
        state,
        free_block_ids=state.free_block_ids + tuple(freed),
        cached_free_block_ids=state.cached_free_block_ids + tuple(freed_cached),
        ref_counts=FrozenMap(ref_counts),
        pending_copies=tuple(
            (source, destination)
            for source, destination in state.pending_copies
            if destination in ref_counts
        ),
    )


def _take_blocks(state: AllocatorState, count: int) -> tuple[AllocatorState, tuple[int, ...]]:
    """Take ``count`` blocks (one reference each): the free queue first, then evict cached ones."""
    from_free = state.free_block_ids[:count]
    evicted = state.cached_free_block_ids[: count - len(from_free)]
    taken = from_free + evicted
    return replace(
        state,
        free_block_ids=state.free_block_ids[len(from_free) :],
        cached_free_block_ids=state.cached_free_block_ids[len(evicted) :],
        cache=FrozenMap({key: b for key, b in state.cache.items() if b not in evicted}),
        ref_counts=_add_references(state.ref_counts, taken),
        counters=replace(state.counters, evictions=state.counters.evictions + len(evicted)),
    ), taken


def _grow(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Add ``token_count`` tokens to a table, copying a shared partly filled last block first."""
    table = snapshot_request(state, request_id)
    block_size = state.block_size
    new_token_count = table.token_count + token_count
    copy_on_write = (
        token_count > 0
        and table.token_count % block_size != 0
        and state.ref_counts[table.block_ids[-1]] > 1
    )
    needed = blocks_for_tokens(block_size, new_token_count) - len(table.block_ids)
    needed += int(copy_on_write)
    if needed > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, needed, free_blocks(state))
    state, taken = _take_blocks(state, needed)
    block_ids = table.block_ids
    if copy_on_write:
        source, destination, taken = block_ids[-1], taken[0], taken[1:]
        block_ids = (*block_ids[:-1], destination)
        state = replace(
            state,
            ref_counts=state.ref_counts.set(source, state.ref_counts[source] - 1),
            pending_copies=(*state.pending_copies, (source, destination)),
            counters=replace(state.counters, cow_copies=state.counters.cow_copies + 1),
        )
    grown = RequestBlockTable(request_id, block_ids + taken, new_token_count)
    return replace(state, tables=state.tables.set(request_id, grown))


def _cache_full_blocks(state: AllocatorState, request_id: str, first_index: int) -> AllocatorState:
    """Cache every full block of the request from ``first_index`` on, unless its prefix is."""
    token_ids = state.token_ids[request_id]
    block_ids = state.tables[request_id].block_ids
    cache = state.cache
    for index in range(first_index, len(token_ids) // state.block_size):
        prefix = token_ids[: (index + 1) * state.block_size]
        if prefix not in cache:
            cache = cache.set(prefix, block_ids[index])
    return replace(state, cache=cache)
