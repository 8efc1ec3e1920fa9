"""The block pool: which blocks are free, who holds how many references, what to copy.

It owns the two free queues, the ref counts, the pending copy-on-write pairs and the
blocks sliding windows freed until the KV pool poisons them, and it takes, releases and
evicts blocks in the order ``spec.allocator`` specifies (as vLLM v1 keeps a ``BlockPool``
apart from its managers). It knows blocks, not requests: the tables are the caller's.
Every operation is O(blocks it moves), with no scan of the pool or the queues. Its
caches emit the KV cache events of keys gained and evicted; a reset emits its one
``AllBlocksCleared`` here.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import ClassVar

from impl.host_pool import HostPool
from impl.prefix_cache import BlockKey, EventSink, PrefixCache
from impl.usage import UsageCounters
from spec import AllBlocksCleared


class BlockPool:
    """``total_blocks`` block ids, free or referenced, and the prefix caches of the groups
    (``caches[g]``: group g's), which decide where a block left unreferenced goes."""

    __slots__ = (
        "cached_free",
        "caches",
        "counters",
        "event_sink",
        "free",
        "host",
        "pending_copies",
        "pending_skipped",
        "ref_counts",
    )

    # The host pool's class; a subclass may swap it (the planted bugs of the tests do).
    host_pool_class: ClassVar[type[HostPool]] = HostPool

    def __init__(
        self,
        total_blocks: int,
        caches: Sequence[PrefixCache],
        counters: UsageCounters,
        event_sink: EventSink | None = None,
        *,
        host_blocks: int,
        host_prefix_cache: bool,
    ) -> None:
        self.event_sink = event_sink
        self.free: deque[int] = deque(range(total_blocks))
        # NOTE: an OrderedDict, not a deque: a prefix hit revives a cached free block from
        # anywhere in the queue, and ``del`` is O(1) there where ``deque.remove`` scans
        # (nano-vllm's scan costs 101 ms for 64 blocks among 131k free). ``popitem(last=
        # False)`` evicts the least recently freed block in O(1).
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.ref_counts: list[int] = [0] * total_blocks
        self.caches = list(caches)
        self.counters = counters
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks windows made free and uncached, in order, until ``take_skipped``; a dict
        # so that an allocation taking one drops it in O(1).
        self.pending_skipped: dict[int, None] = {}
        # The host tier: a block a pending copy out reads waits there, in flight, when its
        # last reference is dropped.
        host_caches = [
            type(cache)(host_blocks, cache.block_hash, group=cache.group) for cache in caches
        ]  # no event sink: host-tier events are not emitted yet
        self.host = self.host_pool_class(host_blocks, host_caches if host_prefix_cache else ())

    @property
    def free_blocks(self) -> int:
        """How many blocks ``take`` may hand out: free and cached free ones."""
        return len(self.free) + len(self.cached_free)

    def take(self, count: int, group: int) -> list[int]:
        """Take ``count`` blocks for ``group``, one reference each: free queue first, then
        evict cached ones. A taken block stops waiting for ``take_skipped``. The caller has
        checked that there are enough."""
        free = self.free
        ref_counts = self.ref_counts
        self.counters.group_used_blocks[group] += count
        if count <= len(free):
            taken = [free.popleft() for _ in range(count)]
            for block_id in taken:
                ref_counts[block_id] = 1
        else:
            taken = []
            for _ in range(count):
                if free:
                    block_id = free.popleft()
                else:
                    block_id, _ = self.cached_free.popitem(last=False)
                    self.evict(block_id)
                    self.counters.evictions += 1
                ref_counts[block_id] = 1
                taken.append(block_id)
        if self.pending_skipped:
            for block_id in taken:
                self.pending_skipped.pop(block_id, None)
        return taken

    def evict(self, block_id: int) -> None:
        """Forget the cached prefix of ``block_id``, in whichever group's cache holds it."""
        for cache in self.caches:
            if cache.block_keys[block_id] is not None:
                cache.evict(block_id)
                return

    def revive(self, block_ids: Iterable[int], group: int) -> None:
        """Add a reference to each of ``block_ids`` (prefix hits of ``group``); a cached
        free block among them leaves its queue, an in-flight one stops being in flight
        (its K/V is whole: a copy out only reads it). The caller counted them."""
        ref_counts = self.ref_counts
        used = self.counters.group_used_blocks
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                if block_id in self.cached_free:
                    del self.cached_free[block_id]
                else:  # in flight: held again, it will not land when its copy is taken
                    del self.host.in_flight[block_id]
                used[group] += 1
            self.add_reference(block_id)

    def add_reference(self, block_id: int) -> None:
        count = self.ref_counts[block_id] + 1
        self.ref_counts[block_id] = count
        if count == 2:
            self.counters.shared_blocks += 1

    def release(
        self, block_ids: Iterable[int], group: int, *, demote: bool = True
    ) -> tuple[list[int], list[int]]:
        """Drop one reference from each of ``block_ids`` (of ``group``) in the order given;
        a block left with none joins the tail of the cached free queue if that group caches
        it, else of the free queue. Returns the blocks that went to each."""
        ref_counts = self.ref_counts
        block_keys = self.caches[group].block_keys
        counters = self.counters
        host = self.host
        copying_out = host.copying_out
        copying_in = host.copying_in
        freed: list[int] = []
        cached: list[int] = []
        flown = 0
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 1:
                counters.shared_blocks -= 1
            elif count == 0:
                if (copying_out or copying_in) and (
                    block_id in copying_out or block_id in copying_in
                ):
                    host.in_flight[block_id] = group  # queued by ``land``
                    flown += 1
                elif (key := block_keys[block_id]) is None:
                    freed.append(block_id)
                elif demote and host.caches and host.demote(block_id, group, key):
                    host.in_flight[block_id] = group  # its copy to the host is pending
                    flown += 1
                else:
                    cached.append(block_id)
                    self.cached_free[block_id] = None
        self.free.extend(freed)
        counters.group_used_blocks[group] -= len(freed) + len(cached) + flown
        if self.pending_copies and (freed or cached or flown):
            # A copy into a block nobody holds any more is moot (see spec.release).
            self.pending_copies = [
                (source, destination)
                for source, destination in self.pending_copies
                if ref_counts[destination]
            ]
        return freed, cached

    def land(self) -> tuple[list[int], list[int]]:
        """Queue the in-flight blocks no pending copy reads any more, in the order they went
        in flight, where ``release`` would have put them; returns those that went to each
        queue. O(blocks in flight)."""
        host = self.host
        busy = host.copying_out.keys() | host.copying_in.keys()
        landed = [item for item in host.in_flight.items() if item[0] not in busy]
        freed: list[int] = []
        cached: list[int] = []
        for block_id, group in landed:
            del host.in_flight[block_id]
            if self.caches[group].block_keys[block_id] is None:
                freed.append(block_id)
            else:
                cached.append(block_id)
                self.cached_free[block_id] = None
        self.free.extend(freed)
        return freed, cached

    def take_swap_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Hand over the copies between the tiers (``HostPool.take_copies``); every
        in-flight block then lands."""
        copies = self.host.take_copies()
        self.land()
        return copies

    def release_exclusive(self, block_ids: list[int]) -> None:
        """Free ``block_ids``, each held once and uncached (group 0 of a request allocated
        by count and never forked), last first: ``release`` without the checks."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 0
        self.free.extend(reversed(block_ids))
        self.counters.group_used_blocks[0] -= len(block_ids)

    def skip(self, block_ids: Iterable[int], group: int) -> None:
        """Release blocks a sliding window no longer reads, in block index order; those that
        became free and uncached wait for ``take_skipped``."""
        freed, _ = self.release(block_ids, group, demote=False)  # as spec: never demoted
        for block_id in freed:
            self.pending_skipped[block_id] = None

    def copy_last_block(self, block_ids: list[int], destination: int) -> None:
        """Copy-on-write: ``destination`` replaces the shared last block of ``block_ids``,
        the pair waits for ``take_copies``."""
        source = block_ids[-1]
        block_ids[-1] = destination
        self.ref_counts[source] -= 1
        if self.ref_counts[source] == 1:
            self.counters.shared_blocks -= 1
        self.pending_copies.append((source, destination))
        self.counters.cow_copies += 1

    def reset_caches(self) -> int:
        """Forget every cached prefix in every group: the cached free blocks join the tail
        of the free queue in their queue order, held blocks lose their keys. Returns how
        many cached blocks were dropped; emits one ``AllBlocksCleared``. O(pool)."""
        dropped = sum(cache.cached_blocks for cache in self.caches)
        for cache in self.caches:
            cache.clear()
        self.free.extend(self.cached_free)
        self.cached_free.clear()
        if self.event_sink is not None:
            self.event_sink(AllBlocksCleared())
        self.host.reset()
        self.land()
        return dropped

    def revive_from_host(
        self, group: int, host_hits: list[tuple[int, int]], keys: list[BlockKey]
    ) -> list[int]:
        """A prefix hit on blocks ``group`` caches on the host only, (block index, host
        block) each: take a device block for each, cache it on the device under its key
        and queue the copy in. Returns the device blocks, in order."""
        device_ids = self.take(len(host_hits), group)
        cache = self.caches[group]
        for (index, _), device_id in zip(host_hits, device_ids, strict=True):
            cache.insert(keys[index], device_id)
        self.host.revive([host_id for _, host_id in host_hits], device_ids)
        return device_ids

    def take_copies(self) -> list[tuple[int, int]]:
        copies = self.pending_copies
        self.pending_copies = []
        return copies

    def take_skipped(self) -> list[int]:
        skipped = list(self.pending_skipped)
        self.pending_skipped.clear()
        return skipped
