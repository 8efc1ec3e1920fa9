"""impl's public API, call by call, as pure functions of a spec state: the one operation table.

Each function takes a state and the arguments of ``KVBlockManager``'s method of the same
name and returns the new state and what that method returns (in spec records: frozen
tables, tuples of block ids). A refused call raises, as the method must, and there is no
new state. ``OPERATIONS`` maps each method name to its function; the state machine, the
bounded checker, the scenario tests and the spec-side benchmark all drive spec through it
and impl by the same name, so an operation is written down once.

``impl.spec_backed.as_article`` turns a result into the record impl hands out (the article's
mutable table, with a ``list`` of block ids), so the two compare with ``==``.
"""

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from spec import allocator, rules, swap
from spec.allocator import AllocatorState
from spec.errors import (
    check_block_id,
    check_cache_salt,
    check_new_tokens,
    check_token_count,
    check_token_ids,
)
from spec.records import (
    AppendedSlots,
    KVBlockUsage,
    PromptAllocation,
    ReleasedBlocks,
    RequestBlockTable,
    SwapCopies,
    SwappedOut,
)

# Any: each step takes its own method's arguments; the table is checked by the tests
# that call every entry against impl, not by the type checker.
Step = Callable[..., tuple[AllocatorState, Any]]


def allocate(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, RequestBlockTable]:
    after = allocator.allocate(state, request_id, token_count)
    return after, allocator.snapshot_request(after, request_id)


def allocate_prompt(
    state: AllocatorState,
    request_id: str,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
) -> tuple[AllocatorState, PromptAllocation]:
    ids = tuple(token_ids)
    after = allocator.allocate_prompt(state, request_id, ids, cache_salt)
    table = allocator.snapshot_request(after, request_id)
    hit_tokens = allocator.cached_prefix_tokens(state, ids, cache_salt)
    return after, PromptAllocation(table, hit_tokens)


def append_tokens(
    state: AllocatorState, request_id: str, token_count: int = 1
) -> tuple[AllocatorState, RequestBlockTable]:
    after = allocator.append_tokens(state, request_id, token_count)
    return after, allocator.snapshot_request(after, request_id)


def append_token_ids(
    state: AllocatorState, request_id: str, token_ids: Sequence[int]
) -> tuple[AllocatorState, RequestBlockTable]:
    after = allocator.append_token_ids(state, request_id, tuple(token_ids))
    return after, allocator.snapshot_request(after, request_id)


def append_slot(state: AllocatorState, request_id: str) -> tuple[AllocatorState, int]:
    """``append_tokens(request_id, 1)``, returning the new token's pool slot in group 0."""
    after = allocator.append_tokens(state, request_id, 1)
    return after, _last_slot(after, request_id)


def append_token_slot(
    state: AllocatorState, request_id: str, token_id: int
) -> tuple[AllocatorState, int]:
    """``append_token_ids(request_id, (token_id,))``, returning the new token's pool slot in
    group 0."""
    after = allocator.append_token_ids(state, request_id, (token_id,))
    return after, _last_slot(after, request_id)


def fork(
    state: AllocatorState, parent_id: str, child_id: str
) -> tuple[AllocatorState, RequestBlockTable]:
    after = allocator.fork(state, parent_id, child_id)
    return after, allocator.snapshot_request(after, child_id)


def truncate(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, RequestBlockTable]:
    after = allocator.truncate(state, request_id, token_count)
    return after, allocator.snapshot_request(after, request_id)


def release(state: AllocatorState, request_id: str) -> tuple[AllocatorState, list[int]]:
    """The request's block ids in table order, as the article's ``release`` returns them."""
    after, released = release_blocks(state, request_id)
    return after, list(released.block_ids)


def release_blocks(state: AllocatorState, request_id: str) -> tuple[AllocatorState, ReleasedBlocks]:
    after = allocator.release(state, request_id)
    return after, _released(state, after, request_id)


def preempt(state: AllocatorState, request_id: str) -> tuple[AllocatorState, ReleasedBlocks]:
    after = allocator.preempt(state, request_id)
    return after, _released(state, after, request_id)


def reset_prefix_cache(state: AllocatorState) -> tuple[AllocatorState, int]:
    """Forget every cached prefix; returns how many cached blocks were dropped (free ones
    and held ones, over every group)."""
    dropped = sum(len(cache) for cache in state.group_caches)
    return allocator.reset_prefix_cache(state), dropped


def take_copies(state: AllocatorState) -> tuple[AllocatorState, list[tuple[int, int]]]:
    return allocator.take_copies(state), list(state.pending_copies)


def take_skipped_blocks(state: AllocatorState) -> tuple[AllocatorState, list[int]]:
    """The blocks windows made free and uncached since the last call, in order; clears them."""
    return allocator.take_skipped_blocks(state), list(state.pending_skipped_block_ids)


def snapshot_request(
    state: AllocatorState, request_id: str, group: int = 0
) -> tuple[AllocatorState, RequestBlockTable]:
    return state, allocator.snapshot_request(state, request_id, group)


# -- every KV cache group at once: what one engine step asks ----------------------------


def snapshot_groups(
    state: AllocatorState, request_id: str
) -> tuple[AllocatorState, tuple[RequestBlockTable, ...]]:
    """The request's table in every group, group 0's first; ``KeyError`` if unknown."""
    allocator.snapshot_request(state, request_id)
    return state, tuple(tables[request_id] for tables in state.group_tables)


def new_token_slots(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, AppendedSlots]:
    """Every group's table and the slots of the request's last ``token_count`` tokens
    (e.g. the first chunk ``allocate_prompt`` gave, past the hit); changes nothing.

    Checks: an ``int`` count ``>= 0`` (TypeError, ValueError), a known request (KeyError),
    at most the tokens it holds (ValueError)."""
    check_token_count(token_count)
    table = allocator.snapshot_request(state, request_id)
    check_new_tokens(request_id, token_count, table.token_count)
    return state, _appended_slots(state, request_id, token_count)


def append_slots(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, AppendedSlots]:
    """``append_tokens``, returning every group's table and the new tokens' slots."""
    after = allocator.append_tokens(state, request_id, token_count)
    return after, _appended_slots(after, request_id, token_count)


def append_token_id_slots(
    state: AllocatorState, request_id: str, token_ids: Sequence[int]
) -> tuple[AllocatorState, AppendedSlots]:
    """``append_token_ids``, returning every group's table and the new tokens' slots."""
    ids = tuple(token_ids)
    after = allocator.append_token_ids(state, request_id, ids)
    return after, _appended_slots(after, request_id, len(ids))


def can_allocate(state: AllocatorState, token_count: int) -> tuple[AllocatorState, bool]:
    """Whether ``allocate`` would find its blocks: one table's worth per group."""
    needed = rules.blocks_for_request(state.block_size, token_count, len(state.group_windows))
    return state, needed <= allocator.free_blocks(state)


def ref_count(state: AllocatorState, block_id: int) -> tuple[AllocatorState, int]:
    """How many tables hold ``block_id``; an id outside the pool is refused
    (``check_block_id``)."""
    return state, state.ref_counts.get(check_block_id(block_id, state.total_blocks), 0)


def usage(state: AllocatorState) -> tuple[AllocatorState, KVBlockUsage]:
    return state, allocator.usage(state)


# -- what chunked prefill and speculative decoding ask ------------------------------------


def cached_prefix_tokens(
    state: AllocatorState, token_ids: Sequence[int], cache_salt: str | None = None
) -> tuple[AllocatorState, int]:
    """The tokens ``allocate_prompt(token_ids, cache_salt)`` would find cached; the state
    is unchanged."""
    ids = tuple(token_ids)
    check_token_ids(ids)
    check_cache_salt(cache_salt)
    return state, allocator.cached_prefix_tokens(state, ids, cache_salt)


def truncate_blocks(
    state: AllocatorState, request_id: str, token_count: int
) -> tuple[AllocatorState, ReleasedBlocks]:
    """``truncate``, reporting the dropped blocks (every group's, group 0's first, in table
    order) and which of them became free or cached free (group by group, last first), as
    ``release_blocks`` reports a whole table."""
    after = allocator.truncate(state, request_id, token_count)
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


# -- the host tier: preemption by swap ------------------------------------------------------


def swap_out(state: AllocatorState, request_id: str) -> tuple[AllocatorState, SwappedOut]:
    """Every device block the request held (every group's, group 0's first, table order),
    the host block each is copied to, and which became free or cached free once the copies
    are taken (release order)."""
    after = swap.swap_out(state, request_id)
    block_ids = tuple(b for tables in state.group_tables for b in tables[request_id].block_ids)
    landing = set(after.host.in_flight_block_ids) - set(state.host.in_flight_block_ids)
    cached = {b for cache in after.group_caches for b in cache.values()}
    in_release_order = [
        b for tables in state.group_tables for b in reversed(tables[request_id].block_ids)
    ]
    return after, SwappedOut(
        block_ids,
        after.host.swapped[request_id].host_block_ids,
        tuple(b for b in in_release_order if b in landing and b not in cached),
        tuple(b for b in in_release_order if b in landing and b in cached),
    )


def swap_in(
    state: AllocatorState, request_id: str
) -> tuple[AllocatorState, tuple[RequestBlockTable, ...]]:
    """The request's table in every group, group 0's first, on its fresh device blocks."""
    after = swap.swap_in(state, request_id)
    return after, tuple(tables[request_id] for tables in after.group_tables)


def take_swap_copies(state: AllocatorState) -> tuple[AllocatorState, SwapCopies]:
    host = state.host
    copies = SwapCopies(host.pending_device_to_host, host.pending_host_to_device)
    return swap.take_swap_copies(state), copies


def is_swapped(state: AllocatorState, request_id: str) -> tuple[AllocatorState, bool]:
    return state, swap.is_swapped(state, request_id)


def can_swap_in(state: AllocatorState, request_id: str) -> tuple[AllocatorState, bool]:
    return state, swap.can_swap_in(state, request_id)


OPERATIONS: Mapping[str, Step] = MappingProxyType(
    {
        "allocate": allocate,
        "allocate_prompt": allocate_prompt,
        "append_tokens": append_tokens,
        "append_token_ids": append_token_ids,
        "append_slot": append_slot,
        "append_token_slot": append_token_slot,
        "fork": fork,
        "truncate": truncate,
        "release": release,
        "release_blocks": release_blocks,
        "preempt": preempt,
        "reset_prefix_cache": reset_prefix_cache,
        "take_copies": take_copies,
        "take_skipped_blocks": take_skipped_blocks,
        "cached_prefix_tokens": cached_prefix_tokens,
        "truncate_blocks": truncate_blocks,
        "snapshot_request": snapshot_request,
        "snapshot_groups": snapshot_groups,
        "new_token_slots": new_token_slots,
        "append_slots": append_slots,
        "append_token_id_slots": append_token_id_slots,
        "can_allocate": can_allocate,
        "ref_count": ref_count,
        "usage": usage,
        "swap_out": swap_out,
        "swap_in": swap_in,
        "take_swap_copies": take_swap_copies,
        "is_swapped": is_swapped,
        "can_swap_in": can_swap_in,
    }
)


def _last_slot(state: AllocatorState, request_id: str) -> int:
    table = allocator.snapshot_request(state, request_id)
    return rules.slot_index(
        state.block_size, table.block_ids, table.token_count - 1, table.skipped_blocks
    )


def _appended_slots(state: AllocatorState, request_id: str, token_count: int) -> AppendedSlots:
    """Every group's table and the slots of its last ``token_count`` positions."""
    tables = tuple(tables[request_id] for tables in state.group_tables)
    return AppendedSlots(
        tables,
        tuple(
            tuple(
                rules.slot_index(state.block_size, t.block_ids, p, t.skipped_blocks)
                for p in range(t.token_count - token_count, t.token_count)
            )
            for t in tables
        ),
    )


def _stale_slots(
    after: AllocatorState, table: RequestBlockTable, before: AllocatorState
) -> tuple[int, ...]:
    """The slots a truncate to ``table.token_count`` made stale in the kept last block of
    ``table``: positions from the new length to the old one, or to the block's end, if the
    block is partly kept and no other table holds it."""
    block_size = after.block_size
    kept = table.token_count
    if kept % block_size == 0 or after.ref_counts[table.block_ids[-1]] > 1:
        return ()
    held_before = before.tables[table.request_id].token_count
    block_end = (table.skipped_blocks + len(table.block_ids)) * block_size
    return tuple(
        rules.slot_index(block_size, table.block_ids, p, table.skipped_blocks)
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
    tables = [tables[request_id].block_ids for tables in before.group_tables]
    block_ids = tuple(block_id for table in tables for block_id in table)
    newly_cached = set(after.cached_free_block_ids) - set(before.cached_free_block_ids)
    now_free = set(after.free_block_ids) - set(before.free_block_ids)
    in_release_order = tuple(block_id for table in tables for block_id in reversed(table))
    return ReleasedBlocks(
        block_ids,
        tuple(b for b in in_release_order if b in now_free),
        tuple(b for b in in_release_order if b in newly_cached),
    )
