"""The one table of operations: the allocator's API, each operation declared once, as a row.

A row names an operation, its transition (a pure function of a spec state and the
operation's arguments, returning the new state and what the call returns, in spec
records), its kind (it changes the state, or it is a query and returns the state as it
was), what each argument is (``Argument``: each test tier draws arguments of that kind
its own way) and the type of its result. A refused call raises, as the method must, and
there is no new state.

``impl.KVCacheManager`` has one method per row, of the same name and arguments, written by
hand; the mirrors are loops over ``OPERATIONS``: ``impl.spec_backed.SpecBackedManager``
answers every row, the lockstep state machine has one rule per row (calling the method of
its name on impl), and the bounded walk tries every row with every argument of its bounds.
The conformance kit is not one of them yet: its spec side is hand-written, its own
operation names (``harness.conformance.adapter.OPERATION_NAMES``, a rule each in its
machine) each mapped onto a spec function (``harness.conformance.properties.SPEC_ROWS``),
so a new row reaches it only by hand (issue 52 moves it onto this table). Adding an
operation is adding a row (``docs/design.md``, "Adding an operation").

``impl.spec_backed.as_impl`` turns a result into the record impl hands out, so the two
compare with ``==``.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

from spec import blocks, caching, growth, releasing, sharing, swap
from spec.errors import check_cache_salt, check_prompt, is_token_ids
from spec.events import CachedBlock
from spec.records import (
    AppendedSlots,
    KVBlockUsage,
    ReleasedBlocks,
    RequestBlockTable,
    Transfers,
)
from spec.rules import slot_index
from spec.state import AllocatorState, get_tables
from spec.state import usage as compute_usage

# Any: each transition takes its own operation's arguments; the tests call every row
# against impl, not the type checker.
Step = Callable[..., tuple[AllocatorState, Any]]


class Kind(Enum):
    """Whether an operation changes the allocator's state or only reads it."""

    CHANGE = "change"
    QUERY = "query"


class Argument(Enum):
    """What an argument of an operation is; the test tiers map each to the values they try
    (``tests.support.lockstep``: Hypothesis strategies, ``tests.support.bounded``: every
    value in bounds), valid and malformed alike."""

    REQUEST_ID = "a request id: new for allocate, held for the others"
    CHILD_ID = "the id of a new request a fork makes"
    TOKENS = "what a request adds: a token count, or token ids"
    TOKEN_COUNT = "a request's length to truncate to"
    CACHE_SALT = "a cache salt, or None"
    PROMPT = "token ids to look up in the prefix cache"


@dataclass(frozen=True, slots=True)
class Operation:
    """One row of the table: an operation of the allocator's API."""

    name: str
    transition: Step
    kind: Kind
    arguments: tuple[Argument, ...]
    result: type


# -- the transitions, as the API returns them ---------------------------------------------


def allocate(
    state: AllocatorState,
    request_id: str,
    tokens: int | Sequence[int],
    cache_salt: str | None = None,
) -> tuple[AllocatorState, AppendedSlots]:
    """``spec.growth.allocate``; the slots of the tokens past the prefix hit."""
    after = growth.allocate(state, request_id, tokens, cache_salt)
    cached = 0
    if is_token_ids(tokens):
        cached = caching.cached_prefix_tokens(state, tuple(tokens), cache_salt)
    new_tokens = after.tables[request_id].token_count - cached
    return after, _appended_slots(after, request_id, new_tokens, cached)


def append(
    state: AllocatorState, request_id: str, tokens: int | Sequence[int] = 1
) -> tuple[AllocatorState, AppendedSlots]:
    """``spec.growth.append``; the slots of the tokens it added."""
    before = state.tables[request_id].token_count if request_id in state.tables else 0
    after = growth.append(state, request_id, tokens)
    added = after.tables[request_id].token_count - before
    return after, _appended_slots(after, request_id, added, 0)


def fork(
    state: AllocatorState, parent_id: str, child_id: str
) -> tuple[AllocatorState, tuple[RequestBlockTable, ...]]:
    """``spec.sharing.fork``; the child's table in every group."""
    after = sharing.fork(state, parent_id, child_id)
    return after, get_tables(after, child_id)


def truncate(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, ReleasedBlocks]:
    """``spec.releasing.truncate``, reporting the dropped blocks (every group's, group 0's
    first, in table order), which of them became free or cached free (group by group, last
    first), as ``release`` reports a whole table, and the stale slots of each group's kept
    last block."""
    after = releasing.truncate(state, request_id, token_count)
    dropped = [
        before[request_id].block_ids[len(now[request_id].block_ids) :]
        for before, now in zip(state.group_tables, after.group_tables, strict=True)
    ]
    in_release_order = [block_id for group in dropped for block_id in reversed(group)]
    now_free = set(after.free_block_ids) - set(state.free_block_ids)
    newly_cached = set(after.cached_free_block_ids) - set(state.cached_free_block_ids)
    return after, ReleasedBlocks(
        tuple(block_id for group in dropped for block_id in group),
        tuple(b for b in in_release_order if b in now_free),
        tuple(b for b in in_release_order if b in newly_cached),
        tuple(_stale_slots(after, tables[request_id], state) for tables in after.group_tables),
    )


def release(state: AllocatorState, request_id: str) -> tuple[AllocatorState, ReleasedBlocks]:
    """``spec.releasing.release``; which of its blocks became free."""
    after = releasing.release(state, request_id)
    return after, _released(state, after, request_id)


def preempt(state: AllocatorState, request_id: str) -> tuple[AllocatorState, ReleasedBlocks]:
    """``spec.releasing.preempt``; which of its blocks became free."""
    after = releasing.preempt(state, request_id)
    return after, _released(state, after, request_id)


def swap_out(state: AllocatorState, request_id: str) -> tuple[AllocatorState, ReleasedBlocks]:
    """``spec.swap.swap_out``: every device block the request held (every group's, group
    0's first, table order), and which of them will be free or cached free once their
    copies are taken (release order; in flight until then)."""
    after = swap.swap_out(state, request_id)
    in_flight = set(after.host.in_flight_block_ids) - set(state.host.in_flight_block_ids)
    cached = {b for cache in after.group_caches for b in cache.values()}
    tables = [tables[request_id].block_ids for tables in state.group_tables]
    in_release_order = [b for table in tables for b in reversed(table)]
    return after, ReleasedBlocks(
        tuple(b for table in tables for b in table),
        tuple(b for b in in_release_order if b in in_flight and b not in cached),
        tuple(b for b in in_release_order if b in in_flight and b in cached),
    )


def swap_in(
    state: AllocatorState, request_id: str
) -> tuple[AllocatorState, tuple[RequestBlockTable, ...]]:
    """``spec.swap.swap_in``; the request's table in every group, on its fresh blocks."""
    after = swap.swap_in(state, request_id)
    return after, get_tables(after, request_id)


def take_transfers(state: AllocatorState) -> tuple[AllocatorState, Transfers]:
    """``spec.blocks.take_transfers``: the copies and freed blocks pending, in order."""
    return blocks.take_transfers(state), blocks.get_transfers(state)


def reset_prefix_cache(state: AllocatorState) -> tuple[AllocatorState, int]:
    """``spec.caching.reset_prefix_cache``; how many cached blocks were dropped (free ones
    and held ones, over every group)."""
    dropped = sum(len(cache) for cache in state.group_caches)
    return caching.reset_prefix_cache(state), dropped


def cached_prefix_tokens(
    state: AllocatorState, token_ids: Sequence[int], cache_salt: str | None = None
) -> tuple[AllocatorState, int]:
    """The tokens ``allocate(request_id, token_ids, cache_salt)`` would find cached
    (``spec.caching.cached_prefix_tokens``). Checks the ids and the salt as ``allocate``."""
    ids = check_prompt(token_ids)
    check_cache_salt(cache_salt)
    return state, caching.cached_prefix_tokens(state, ids, cache_salt)


def tables(
    state: AllocatorState, request_id: str
) -> tuple[AllocatorState, tuple[RequestBlockTable, ...]]:
    """The request's table in every group, group 0's first; ``KeyError`` if it holds no
    device blocks (unknown, or swapped out)."""
    return state, get_tables(state, request_id)


def cache_view(state: AllocatorState) -> tuple[AllocatorState, frozenset[CachedBlock]]:
    """Every (group, block id, key) the device's prefix caches hold, free blocks and held
    ones (``spec.caching.get_cached_blocks``): what replaying every KV cache event emitted
    so far gives, and what a consumer that missed some resyncs from."""
    return state, caching.get_cached_blocks(state)


def usage(state: AllocatorState) -> tuple[AllocatorState, KVBlockUsage]:
    """The usage report (``spec.state.usage``)."""
    return state, compute_usage(state)


# -- the table ----------------------------------------------------------------------------

REQUEST_ID, CHILD_ID, TOKENS, TOKEN_COUNT, CACHE_SALT, PROMPT = Argument
CHANGE, QUERY = Kind


def _row(transition: Step, kind: Kind, arguments: tuple[Argument, ...], result: type) -> Operation:
    return Operation(transition.__name__, transition, kind, arguments, result)


OPERATIONS: Mapping[str, Operation] = MappingProxyType(
    {
        row.name: row
        for row in (
            _row(allocate, CHANGE, (REQUEST_ID, TOKENS, CACHE_SALT), AppendedSlots),
            _row(append, CHANGE, (REQUEST_ID, TOKENS), AppendedSlots),
            _row(fork, CHANGE, (REQUEST_ID, CHILD_ID), tuple),
            _row(truncate, CHANGE, (REQUEST_ID, TOKEN_COUNT), ReleasedBlocks),
            _row(release, CHANGE, (REQUEST_ID,), ReleasedBlocks),
            _row(preempt, CHANGE, (REQUEST_ID,), ReleasedBlocks),
            _row(swap_out, CHANGE, (REQUEST_ID,), ReleasedBlocks),
            _row(swap_in, CHANGE, (REQUEST_ID,), tuple),
            _row(take_transfers, CHANGE, (), Transfers),
            _row(reset_prefix_cache, CHANGE, (), int),
            _row(cached_prefix_tokens, QUERY, (PROMPT, CACHE_SALT), int),
            _row(tables, QUERY, (REQUEST_ID,), tuple),
            _row(cache_view, QUERY, (), frozenset),
            _row(usage, QUERY, (), KVBlockUsage),
        )
    }
)


# -- building the results -----------------------------------------------------------------


def _appended_slots(
    state: AllocatorState, request_id: str, new_tokens: int, cached_tokens: int
) -> AppendedSlots:
    """The request in every group, and the slots of its last ``new_tokens`` positions (none
    in a state group: its one block holds a state, not a token's K/V)."""
    held = get_tables(state, request_id)
    token_count = held[0].token_count
    return AppendedSlots(
        request_id,
        token_count,
        tuple(t.block_ids for t in held),
        tuple(t.skipped_blocks for t in held),
        tuple(
            kind.slots(state.block_size, t, range(token_count - new_tokens, token_count))
            for kind, t in zip(state.group_windows, held, strict=True)
        ),
        cached_tokens,
    )


def _stale_slots(
    after: AllocatorState, table: RequestBlockTable, before: AllocatorState
) -> tuple[int, ...]:
    """The slots a truncate to ``table.token_count`` made stale in the kept last block of
    ``table``: positions from the new length to the old one, or to the block's end, if the
    block is partly kept, no other table holds it and it is not cached (a cached block's
    slots are its key's K/V until a write changes it)."""
    block_size = after.block_size
    kept = table.token_count
    if kept % block_size == 0:
        return ()
    last = table.block_ids[-1]
    if after.ref_counts[last] > 1 or any(last in cache.values() for cache in after.group_caches):
        return ()
    held_before = before.tables[table.request_id].token_count
    block_end = (table.skipped_blocks + len(table.block_ids)) * block_size
    return tuple(
        slot_index(block_size, table.block_ids, p, table.skipped_blocks)
        for p in range(kept, min(held_before, block_end))
    )


def _released(before: AllocatorState, after: AllocatorState, request_id: str) -> ReleasedBlocks:
    """Every group's blocks in table order (group 0's first), and which became free, in
    release order (group by group, last block first). A swapped-out request holds no
    device block; the in-flight blocks whose copies into its host blocks were dropped
    joined the queues' tails."""
    if request_id in before.host.swapped:
        return ReleasedBlocks(
            (),
            after.free_block_ids[len(before.free_block_ids) :],
            after.cached_free_block_ids[len(before.cached_free_block_ids) :],
        )
    held = [tables[request_id].block_ids for tables in before.group_tables]
    block_ids = tuple(block_id for table in held for block_id in table)
    newly_cached = set(after.cached_free_block_ids) - set(before.cached_free_block_ids)
    now_free = set(after.free_block_ids) - set(before.free_block_ids)
    in_release_order = tuple(block_id for table in held for block_id in reversed(table))
    return ReleasedBlocks(
        block_ids,
        tuple(b for b in in_release_order if b in now_free),
        tuple(b for b in in_release_order if b in newly_cached),
    )
