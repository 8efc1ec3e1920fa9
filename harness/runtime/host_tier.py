"""The engine's side of the host tier: preempting a victim by swap or recompute, and
making the manager's pending swap copies in the store, counted and timed.

The manager decides which device and host blocks a swap uses; the store
(``harness.runtime.kv_pool``, ``harness.runtime.host_store``) moves the K/V; the engine
decides when. The order is the manager's pending-copy rule made concrete: a victim's
copies are made before any block it gave up is handed out again, and a poisoned pool
fills those blocks only after their copy out. Every batch of copies is made as the
manager orders them (``SwapCopies``): all device -> host, then the copy-on-write copies,
then all host -> device (a copy-on-write source freed before its copy may be a copy in's
target).
"""

import time
from collections.abc import Callable

from harness.runtime.kv_store import KVStore
from harness.runtime.preemption import PreemptMode, preempt_request
from harness.runtime.requests import RunningRequest
from harness.runtime.results import HostTierCounts
from impl import KVBlockManager, SwapCopies


class HostTierSteps:
    """Preemptions and swap copies for one engine's manager and store; ``copy_on_write``
    makes the manager's pending copy-on-write copies in the store."""

    __slots__ = ("_host_hits_before", "copy_on_write", "counts", "manager", "mode", "store")

    def __init__(
        self,
        manager: KVBlockManager,
        store: KVStore,
        mode: PreemptMode,
        copy_on_write: Callable[[], None],
    ) -> None:
        self.manager = manager
        self.store = store
        self.mode: PreemptMode = mode
        self.copy_on_write = copy_on_write
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

    def swap_in(self, admit: Callable[[], bool]) -> bool:
        """``admit()`` of a swapped-out request (the scheduler's ``swap_in``), timed and
        counted; whether it came back."""
        started = time.perf_counter()
        admitted = admit()
        self.counts.swap_s += time.perf_counter() - started
        self.counts.swaps_in += admitted
        return admitted

    def recomputed(self, start: int, end: int, dropped: int) -> None:
        """A prefill fed positions ``start .. end - 1`` of a request whose K/V a recompute
        preemption dropped below ``dropped``: count the ones it computes again."""
        self.counts.recomputed_tokens += max(0, min(end, dropped) - start)

    def preempt(self, running: RunningRequest) -> bool:
        """Preempt ``running`` (``preempt_request`` makes its copies), then let the store
        have the device blocks it gave up; whether it was swapped out (else recomputed)."""
        request_id = running.request.request_id
        started = time.perf_counter()
        preempted = preempt_request(self.manager, request_id, self.mode, self.swap)
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

    def copy_pending(self) -> None:
        """Make every pending copy: swap-ins', host prefix hits', the host prefix cache's
        copies of freed cached blocks, and the copy-on-write ones between."""
        started = time.perf_counter()
        self.swap(self.manager.take_swap_copies())
        self.counts.swap_s += time.perf_counter() - started

    def swap(self, copies: SwapCopies) -> None:
        """``copies`` in the store, every copy out, then the copy-on-write ones, then every
        copy in; counted."""
        if copies.device_to_host:
            self.store.swap(copies.device_to_host, [])
            self.counts.blocks_to_host += len(copies.device_to_host)
        self.copy_on_write()
        if copies.host_to_device:
            self.store.swap([], copies.host_to_device)
            self.counts.blocks_to_device += len(copies.host_to_device)
