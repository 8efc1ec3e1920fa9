"""Preemption by swap: a request's blocks copied to the host tier and back, as pure
transitions of a spec state (the host tier's state is ``spec.host_tier``'s).

- ``swap_out`` gives every block the request holds, in every group, a host block (the
  host free queue's head first, then the least recently used evictable host-cached
  block), queues the (device -> host) copies, and drops the request's references as
  ``release`` does: a block no table holds any more is in flight until
  ``take_transfers`` (the pending-copy rule), a block another table holds stays theirs.
  Blocks a window skipped are not copied: the request keeps its ``skipped_blocks``. The
  request is then swapped: it holds no device block, keeps its length, token ids and
  salt, and only ``swap_in``, ``release`` (and ``preempt``) know it.
- ``swap_in`` takes fresh device blocks for every host block (from the queues, as any
  allocation: sharing is not restored), queues the (host -> device) copies and makes the
  request running again; its host blocks are freed when ``take_transfers`` hands the
  copies over. Its blocks are not cached again: the keys they held are still cached on
  the blocks that kept them, or were evicted.
- ``take_transfers`` (``spec.blocks``) hands over every pending copy between the tiers;
  in-flight device blocks then join the queues' tails (cached free if a group caches
  them, else free) and the host blocks read by (host -> device) copies join the host free
  queue's tail.

A swap-out is refused while a pending copy still writes into one of the request's blocks:
its K/V is not there yet to copy out.
"""

from dataclasses import replace

from spec.blocks import take_blocks
from spec.errors import (
    BlockAllocationError,
    awaits_copy,
    check_host_room,
    not_swapped,
)
from spec.host_tier import (
    SwappedRequest,
    host_free_blocks,
    take_host_blocks,
)
from spec.records import RequestBlockTable
from spec.releasing import release
from spec.state import AllocatorState, free_blocks, set_table, snapshot_request


def is_swapped(state: AllocatorState, request_id: str) -> bool:
    """Whether ``request_id`` is swapped out to the host tier."""
    return request_id in state.host.swapped


def swapped_request(state: AllocatorState, request_id: str) -> SwappedRequest:
    """The host record of a swapped-out request; ``KeyError`` if it is not swapped out."""
    swapped = state.host.swapped.get(request_id)
    if swapped is None:
        not_swapped(request_id)
    return swapped


def swap_out(state: AllocatorState, request_id: str) -> AllocatorState:
    """Copy every block ``request_id`` holds to the host tier and drop its references.

    Checks: a running request (KeyError); no block of it the destination of a pending
    copy (ValueError); a host tier, with a host block for each of its blocks, counting
    the evictable host-cached ones (``check_host_room``: ``HostBlockAllocationError``, a
    ``BlockAllocationError``).
    """
    snapshot_request(state, request_id)
    tables = [tables[request_id] for tables in state.group_tables]
    awaited = {d for _, d in state.pending_copies} | {
        d for _, d in state.host.pending_host_to_device
    }
    for table in tables:
        for block_id in table.block_ids:
            if block_id in awaited:
                awaits_copy(request_id, block_id)
    device_ids = tuple(block_id for table in tables for block_id in table.block_ids)
    check_host_room(
        request_id, len(device_ids), host_free_blocks(state.host), state.host.host_blocks
    )
    host, host_ids = take_host_blocks(state.host, len(device_ids))
    host = replace(
        host,
        pending_device_to_host=host.pending_device_to_host
        + tuple(zip(device_ids, host_ids, strict=True)),
    )
    group_host_ids: list[tuple[int, ...]] = []
    for table in tables:
        group_host_ids.append(host_ids[: len(table.block_ids)])
        host_ids = host_ids[len(table.block_ids) :]
    record = SwappedRequest(
        tuple(group_host_ids),
        tables[0].token_count,
        tuple(table.skipped_blocks for table in tables),
        state.token_ids.get(request_id),
        state.cache_salts.get(request_id),
    )
    state = release(replace(state, host=host), request_id)
    counters = replace(
        state.host.counters,
        swapped_out_blocks=state.host.counters.swapped_out_blocks + len(device_ids),
    )
    host = replace(
        state.host, swapped=state.host.swapped.set(request_id, record), counters=counters
    )
    return replace(state, host=host)


def swap_in(state: AllocatorState, request_id: str) -> AllocatorState:
    """Give a swapped-out request fresh device blocks, one per host block, group by group
    (group 0's first), and queue the (host -> device) copies.

    Checks: a swapped-out request (KeyError), enough device blocks (BlockAllocationError).
    """
    record = swapped_request(state, request_id)
    needed = len(record.host_block_ids)
    if needed > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, needed, free_blocks(state))
    copies: list[tuple[int, int]] = []
    for group, host_ids in enumerate(record.group_host_block_ids):
        state, taken = take_blocks(state, len(host_ids))
        copies += zip(host_ids, taken, strict=True)
        skipped = record.group_skipped_blocks[group]
        table = RequestBlockTable(request_id, taken, record.token_count, skipped)
        state = set_table(state, group, table)
    if record.token_ids is not None:
        state = replace(state, token_ids=state.token_ids.set(request_id, record.token_ids))
    if record.cache_salt is not None:
        state = replace(state, cache_salts=state.cache_salts.set(request_id, record.cache_salt))
    counters = replace(
        state.host.counters, swapped_in_blocks=state.host.counters.swapped_in_blocks + needed
    )
    host = replace(
        state.host,
        swapped=state.host.swapped.delete(request_id),
        pending_host_to_device=state.host.pending_host_to_device + tuple(copies),
        counters=counters,
    )
    return replace(state, host=host)
