"""Preemption by swap in impl: ``spec.swap``'s transitions on the block pool, the host pool
and a request's ``Table``.

A swapped-out request keeps its own ``Table`` object (token ids, keys, salt and skips
stay as they were) in ``HostPool.swapped``, with its host blocks beside it; swap-in
gives the same object fresh device blocks. Each call is O(blocks moved + copies
pending). The front (``impl.manager``) has checked every argument and every refusal
before it calls in.
"""

from itertools import islice

from impl.block_pool import BlockPool
from impl.groups import KVCacheGroups
from impl.host_pool import Swapped
from impl.tables import Table
from spec import ReleasedBlocks, SwappedOut


def swap_out(pool: BlockPool, groups: KVCacheGroups, request_id: str, table: Table) -> SwappedOut:
    """Give each block of ``table`` (removed from the tables by the caller) a host block,
    queue the copies out, drop the table's references as ``release`` does and file the
    table as swapped out."""
    host = pool.host
    device_ids = [block_id for held in table.group_block_ids for block_id in held]
    host_ids = host.take(len(device_ids))
    host.copy_out(device_ids, host_ids)
    # NOTE: nothing lands during this release (no block of the table awaits a copy in:
    # the front refused that), so the blocks it sends in flight are the dict's new tail.
    flying_before = len(host.in_flight)
    groups.release(table)
    flown = list(islice(host.in_flight.items(), flying_before, None))
    group_host_ids: list[list[int]] = []
    start = 0
    for held in table.group_block_ids:
        group_host_ids.append(host_ids[start : start + len(held)])
        start += len(held)
    table.group_block_ids = [[] for _ in table.group_block_ids]
    host.swapped[request_id] = Swapped(table, group_host_ids)
    host.swapped_host_blocks += len(host_ids)
    host.swapped_out_blocks += len(host_ids)
    caches = pool.caches
    return SwappedOut(
        tuple(device_ids),
        tuple(host_ids),
        tuple(b for b, group in flown if caches[group].block_keys[b] is None),
        tuple(b for b, group in flown if caches[group].block_keys[b] is not None),
    )


def swap_in(pool: BlockPool, swapped: Swapped) -> Table:
    """Give a swapped-out table fresh device blocks, one per host block, group by group,
    and queue the copies in; the caller files the table again. Its blocks are its own,
    but it is not ``exclusive``: a release must drop its pending copies in, and only the
    general release does."""
    host = pool.host
    table = swapped.table
    table.group_block_ids = [
        pool.take(len(host_ids), group)
        for group, host_ids in enumerate(swapped.group_host_block_ids)
    ]
    table.exclusive = False
    moved = 0
    for host_ids, device_ids in zip(
        swapped.group_host_block_ids, table.group_block_ids, strict=True
    ):
        host.copy_in(host_ids, device_ids)
        moved += len(host_ids)
    host.swapped_host_blocks -= moved
    host.swapped_in_blocks += moved
    return table


def release_swapped(pool: BlockPool, request_id: str) -> ReleasedBlocks:
    """``release`` of a swapped-out request: its host blocks to the host free queue's tail
    (group by group, last block first); an in-flight block no copy reads any more lands."""
    host = pool.host
    swapped = host.swapped.pop(request_id)
    host.swapped_host_blocks -= sum(len(group) for group in swapped.group_host_block_ids)
    host.release(b for group in swapped.group_host_block_ids for b in reversed(group))
    freed, cached = pool.land()
    return ReleasedBlocks((), tuple(freed), tuple(cached))
