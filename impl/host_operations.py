"""The host tier's operations of ``impl.KVBlockManager``: preemption by swap.

``HostTierOperations`` is the front of ``spec.swap``: it checks every argument and every
refusal, then hands the work to ``impl.swap`` (the pool, the host pool and a ``Table``).
The host tier itself (``impl.host_pool.HostPool``) is built with the block pool by
``ManagerBase``; a release of a swapped-out request is ``KVBlockManager.release``'s.
"""

from dataclasses import dataclass

from impl import swap
from impl.manager_base import ManagerBase
from impl.records import RequestBlockTable, SwapCopies
from spec import (
    BlockAllocationError,
    HostBlockAllocationError,
    SwappedOut,
    awaits_copy,
    not_swapped,
)


@dataclass(eq=False)
class HostTierOperations(ManagerBase):
    """Swap-out, swap-in and the copies between the tiers (``docs/design.md``, "The host
    tier")."""

    def swap_out(self, request_id: str) -> SwappedOut:
        """Copy every block the request holds (every group's; skipped ones are not held) to
        the host tier and drop its references as ``release`` does; the request is swapped
        out until ``swap_in`` or ``release``. O(blocks + copies pending).

        Refused while a pending copy writes into one of its blocks (``ValueError``: take the
        copies first) and when the host tier is short (``HostBlockAllocationError``).
        """
        table = self._table(request_id)
        host = self._host
        awaited = {destination for _, destination in self._pool.pending_copies}
        awaited.update(destination for _, destination in host.pending_in)
        if awaited:
            for held in table.group_block_ids:
                for block_id in held:
                    if block_id in awaited:
                        awaits_copy(request_id, block_id)
        needed = sum(len(held) for held in table.group_block_ids)
        available = host.free_blocks
        if needed > available:
            raise HostBlockAllocationError.out_of_blocks(request_id, needed, available)
        del self._tables[request_id]
        self._counters.allocated_tokens -= table.token_count
        return swap.swap_out(self._pool, self._groups, request_id, table)

    def swap_in(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        """Give a swapped-out request fresh device blocks (sharing is not restored) and queue
        the copies from its host blocks; returns every group's table. O(blocks).

        Refused when the device is short (``BlockAllocationError``)."""
        swapped = self._host.swapped.get(request_id)
        if swapped is None:
            not_swapped(request_id)
        needed = sum(len(host_ids) for host_ids in swapped.group_host_block_ids)
        available = self._pool.free_blocks
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        del self._host.swapped[request_id]
        table = swap.swap_in(self._pool, swapped)
        self._tables[request_id] = table
        self._counters.allocated_tokens += table.token_count
        return tuple(table.snapshot(request_id, g) for g in range(len(table.group_block_ids)))

    def take_swap_copies(self) -> SwapCopies:
        """The copies between the tiers to make now, in order; clears them. The KV pool makes
        every (device -> host) copy, then ``take_copies``' ones, then every (host -> device)
        copy. The device blocks that were in flight then join the queues."""
        device_to_host, host_to_device = self._pool.take_swap_copies()
        return SwapCopies(device_to_host, host_to_device)

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request is swapped out to the host tier."""
        return request_id in self._host.swapped

    def can_swap_in(self, request_id: str) -> bool:
        """Whether ``swap_in`` would find its device blocks now; ``KeyError`` if the request
        is not swapped out."""
        swapped = self._host.swapped.get(request_id)
        if swapped is None:
            not_swapped(request_id)
        needed = sum(len(host_ids) for host_ids in swapped.group_host_block_ids)
        return needed <= self._pool.free_blocks
