"""Release and preemption: a request gives its blocks back, all of them (``release``,
``preempt``) or those past a shorter length (``truncate``).

A released block loses one reference; a block left with none goes where
``spec.blocks.release_in_order`` sends it (the cached free queue if it holds a cached
prefix, else the free queue, or in flight while a copy between the tiers touches it),
group by group, last block first, so that a cached prompt's first blocks are evicted
last.
"""

from dataclasses import replace

from spec.blocks import drop_references, with_host
from spec.errors import check_token_count, check_truncate
from spec.host_tier import release_host_blocks
from spec.state import (
    AllocatorState,
    forget_request,
    set_group_tables,
    set_table,
    snapshot_request,
)


def release(state: AllocatorState, request_id: str) -> AllocatorState:
    """Drop a request: each of its blocks loses a reference, group by group, last block first.

    Checks: a known request (KeyError). A pending copy into a block left free is dropped.

    A swapped-out request holds no device block: its host blocks join the host free
    queue's tail, group by group, last block first; a pending copy into one is dropped
    (its device block, in flight, goes where this release would have sent it).
    """
    if request_id in state.host.swapped:
        return _release_swapped(state, request_id)
    snapshot_request(state, request_id)
    for group, tables in enumerate(state.group_tables):
        state = drop_references(state, tables[request_id].block_ids)
        state = set_group_tables(state, group, state.group_tables[group].delete(request_id))
    return forget_request(state, request_id)


def preempt(state: AllocatorState, request_id: str) -> AllocatorState:
    """Release a request the engine preempts to recompute later; counts the preemption."""
    state = release(state, request_id)
    counters = replace(state.counters, preemptions=state.counters.preemptions + 1)
    return replace(state, counters=counters)


def truncate(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Shrink a request to its first ``token_count`` tokens: the rollback of rejected
    speculative tokens.

    Checks: an ``int`` ``token_count >= 0`` (TypeError, ValueError), a known request
    (KeyError), ``token_count`` at most the request's tokens (ValueError), not below them
    in a pool with a state group (ValueError: a state cannot be rewound), and no group
    with window W that skipped a block the shorter request would read again, i.e. with
    ``skipped_blocks * block_size > max(0, token_count - W + 1)`` (ValueError): its K/V is
    gone. In each group the blocks wholly beyond the new length are dropped as ``release``
    drops a table's blocks (last first, to the tails of the queues). A new last block that
    is partly filled keeps its key if it has one: its K/V is still the whole key's until a
    write changes it, and the next append forgets the key first (``spec.growth``), or
    copies the block if another table holds it. Tokens past the new length are forgotten.
    """
    check_token_count(token_count)
    table = snapshot_request(state, request_id)
    check_truncate(
        request_id,
        token_count,
        table.token_count,
        block_size=state.block_size,
        group_windows=state.group_windows,
        skipped_blocks=[tables[request_id].skipped_blocks for tables in state.group_tables],
    )
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        kind = state.group_windows[group]
        held = kind.table_blocks(state.block_size, token_count) - table.skipped_blocks
        state = drop_references(state, table.block_ids[held:])
        kept = table.block_ids[:held]
        state = set_table(state, group, replace(table, block_ids=kept, token_count=token_count))
    if request_id in state.token_ids:
        ids = state.token_ids[request_id][:token_count]
        state = replace(state, token_ids=state.token_ids.set(request_id, ids))
    return state


def _release_swapped(state: AllocatorState, request_id: str) -> AllocatorState:
    """``release`` of a swapped-out request: its host blocks join the host free queue's tail
    (group by group, last block first)."""
    swapped = state.host.swapped[request_id]
    host = release_host_blocks(
        replace(state.host, swapped=state.host.swapped.delete(request_id)),
        (b for group in swapped.group_host_block_ids for b in reversed(group)),
    )
    return with_host(state, host)
