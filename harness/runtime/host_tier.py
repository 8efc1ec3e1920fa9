"""The engine's side of the manager's transfers: preempting a victim by swap or recompute,
and making every transfer the manager hands over in the store, counted and timed.

The manager decides which device and host blocks a copy uses; the store
(``harness.runtime.kv_pool``, ``harness.runtime.host_store``) moves the K/V; the engine
decides when. The order is the manager's (``Transfers``): all device -> host copies, then
the copy-on-write copies, then all host -> device copies (a copy-on-write source freed
before its copy may be a copy in's target), then the blocks windows freed. A victim's
transfers are made before any block it gave up is handed out again, and a poisoned pool
fills those blocks only after their copy out.
"""

import time

from harness.runtime.kv_store import KVStore
from harness.runtime.preemption import PreemptMode, preempt_request
from harness.runtime.requests import RunningRequest
from harness.runtime.results import HostTierCounts
from impl import KVCacheManager, Transfers


class HostTierSteps:
    """Preemptions and transfers for one engine's manager and store, with their counts."""

    __slots__ = ("_host_hits_before", "counts", "manager", "mode", "store")

    def __init__(self, manager: KVCacheManager, store: KVStore, mode: PreemptMode) -> None:
        self.manager = manager
        self.store = store
        self.mode: PreemptMode = mode
        self.counts = HostTierCounts()
        self._host_hits_before = 0

    def start_run(self) -> None:
        """Count from zero: a run starts."""
        self.counts = HostTierCounts()
        self._host_hits_before = self.manager.usage().host_hit_blocks

    def end_run(self) -> HostTierCounts:
        """The run's counts, its host prefix hits (the manager's) included."""
        hits = self.manager.usage().host_hit_blocks - self._host_hits_before
        self.counts.host_prefix_hit_tokens = hits * self.manager.block_size
        return self.counts

    def resumed(self, swapped_in: bool, seconds: float) -> None:
        """A swapped-out request's admission was tried, taking ``seconds``; counted."""
        self.counts.swap_s += seconds
        self.counts.swaps_in += swapped_in

    def recomputed(self, start: int, end: int, dropped: int) -> None:
        """A prefill fed positions ``start .. end - 1`` of a request whose K/V a recompute
        preemption dropped below ``dropped``: count the ones it computes again."""
        self.counts.recomputed_tokens += max(0, min(end, dropped) - start)

    def preempt(self, running: RunningRequest) -> bool:
        """Preempt ``running`` and make its transfers, then let the store have the device
        blocks it gave up; whether it was swapped out (else recomputed)."""
        request_id = running.request.request_id
        started = time.perf_counter()
        preempted = preempt_request(self.manager, request_id, self.mode)
        self._make(preempted.transfers)
        freed = list(preempted.freed_block_ids)
        if preempted.swapped:
            self.store.swap_out(request_id, freed)
            running.swapped = True
            self.counts.swaps_out += 1
        else:
            self.store.release(request_id, freed)
            running.dropped = max(running.dropped, running.computed)
            self.counts.recomputes += 1
        self.counts.swap_s += time.perf_counter() - started
        return preempted.swapped

    def transfer(self, transfers: Transfers) -> None:
        """``transfers`` in the store, in their order; the copies between the tiers counted
        and timed."""
        if not (transfers.device_to_host or transfers.host_to_device):
            self.store.transfer(transfers)
            return
        started = time.perf_counter()
        self._make(transfers)
        self.counts.swap_s += time.perf_counter() - started

    def _make(self, transfers: Transfers) -> None:
        self.store.transfer(transfers)
        self.counts.blocks_to_host += len(transfers.device_to_host)
        self.counts.blocks_to_device += len(transfers.host_to_device)
