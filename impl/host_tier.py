"""The host tier: host block ids, the requests swapped out to them, the copies between
the tiers that the KV pool has not made yet, and the host prefix cache
(``spec.host_tier``'s state, mutable).

It sits beside the block pool, as vLLM's offloading connector sits beside its
``BlockPool``: the pool drops a block's last reference and hands it back, and the host
tier keeps in flight the ones a pending copy pins (``keep_in_flight``), until
``take_copies`` hands the copies over and they go to the pool's queues. With the host
prefix cache it also copies out the cached blocks a release frees (demotion), which go to
the pool's queues at once; an allocation that takes one before its copy is taken makes
the demotion moot (``drop_moot_demotion``). It knows host blocks and which device blocks
the copies touch, not the device queues. Every operation is O(blocks it moves + copies
pending), with no scan of either pool.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice

from impl.prefix_cache import BlockKey, PrefixCache
from impl.tables import Table

# A device block and the KV cache group whose table last held it.
GroupBlock = tuple[int, int]


class SwappedRequest:
    """A swapped-out request: its own ``Table`` (token ids, keys, salt and skips kept; no
    device block) and its host blocks per KV cache group, in table order (the mutable twin
    of ``spec.SwappedRequest``)."""

    __slots__ = ("group_host_block_ids", "table")

    def __init__(self, table: Table, group_host_block_ids: list[list[int]]) -> None:
        self.table = table
        self.group_host_block_ids = group_host_block_ids

    @property
    def host_blocks(self) -> int:
        return sum(len(host_ids) for host_ids in self.group_host_block_ids)


class HostTier:
    """``host_blocks`` host block ids, free, lent to swapped-out requests or holding a
    demoted prefix (``caches[g]``: group g's host prefix cache, none without one), and the
    copies between the tiers in the order they were made."""

    __slots__ = (
        "caches",
        "copied_host_ids",
        "copying_in",
        "copying_out",
        "demoting",
        "free",
        "host_blocks",
        "host_hit_blocks",
        "in_flight",
        "lru",
        "pending_in",
        "pending_out",
        "swapped",
        "swapped_host_blocks",
        "swapped_in_blocks",
        "swapped_out_blocks",
    )

    def __init__(self, host_blocks: int, caches: Sequence[PrefixCache] = ()) -> None:
        self.host_blocks = host_blocks
        self.caches = list(caches)
        # The host-cached blocks, least recently used first, with their group.
        self.lru: OrderedDict[int, int] = OrderedDict()
        # Host blocks a pending copy has written or read since the last ``take_copies``: a
        # host-cached one among them is not reused before its copy is made.
        # NOTE: a set, not a count per block, and nothing leaves it until ``take_copies``:
        # only host-cached blocks are looked up here, and a block leaves the host cache
        # only to the free queue (``reset``), from which it is cached again only by a
        # demotion, whose copy out adds it anyway. A stale entry is never read.
        self.copied_host_ids: set[int] = set()
        self.host_hit_blocks = 0
        self.free: deque[int] = deque(range(host_blocks))
        self.swapped: dict[str, SwappedRequest] = {}
        self.pending_out: list[tuple[int, int]] = []  # (device block, host block)
        self.pending_in: list[tuple[int, int]] = []  # (host block, device block)
        # Device block -> how many pending swap-out copies read it (a block two forks share
        # may be copied out by both).
        self.copying_out: dict[int, int] = {}
        # Device block -> the host block its pending demotion writes (one at most: a
        # block's key is on the host once it is demoted, so it is not demoted again).
        self.demoting: dict[int, int] = {}
        # The device blocks the pending copies in write, each once.
        self.copying_in: dict[int, None] = {}
        # Device block -> its KV cache group, in the order it went in flight (release order).
        self.in_flight: dict[int, int] = {}
        self.swapped_host_blocks = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @property
    def prefix_cache(self) -> bool:
        """Whether freed cached blocks are demoted to this tier."""
        return bool(self.caches)

    @property
    def free_blocks(self) -> int:
        """How many host blocks a swap-out may take now: free ones and the host-cached ones
        no pending copy touches. O(pending copies)."""
        lru = self.lru
        copied = self.copied_host_ids
        return len(self.free) + len(lru) - sum(1 for host_id in copied if host_id in lru)

    def is_copying(self, block_id: int) -> bool:
        """Whether a pending copy pins device block ``block_id`` (a swap-out's copy out
        reads it or a copy in writes it; a demotion's does not pin)."""
        return block_id in self.copying_out or block_id in self.copying_in

    def keep_in_flight(
        self, block_ids: list[int], group: int, cache: PrefixCache, *, demote: bool
    ) -> list[int]:
        """Of ``block_ids``, device blocks of ``group`` just left unreferenced (in release
        order), keep in flight those a pending copy pins and, with ``demote`` and the host
        prefix cache, write the cached others through to it (``write_through``); returns
        those not in flight, in order, for the pool's queues."""
        copying_out, copying_in = self.copying_out, self.copying_in
        rest = block_ids
        if copying_out or copying_in:
            rest = []
            for block_id in block_ids:
                if block_id in copying_out or block_id in copying_in:
                    self.in_flight[block_id] = group
                else:
                    rest.append(block_id)
        if demote and self.caches:
            self.write_through(rest, group, cache)
        return rest

    def write_through(self, block_ids: list[int], group: int, cache: PrefixCache) -> None:
        """The host prefix cache's part of a release (``spec.blocks``): of ``block_ids``
        (unreferenced, in release order), the cached ones whose key the host lacks get a
        host copy, the last released first, as many as the host has blocks for, copied the
        head first; then every key of theirs the host holds becomes its most recently used
        in release order (those it had already first, out of the demotions' way)."""
        host_cache = self.caches[group]
        block_keys = cache.block_keys
        keys = [(b, key) for b in block_ids if (key := block_keys[b]) is not None]
        if not keys:
            return
        lru = self.lru
        on_host = [host_cache.find(key) for _, key in keys]
        for host_id in on_host:
            if host_id is not None:
                lru.move_to_end(host_id)
        demotable = [keys[i] for i, host_id in enumerate(on_host) if host_id is None]
        for block_id, key in reversed(demotable[max(0, len(demotable) - self.free_blocks) :]):
            self.demote(block_id, group, key)
        for _, key in keys:
            if (host_id := host_cache.find(key)) is not None:
                lru.move_to_end(host_id)

    def hold_again(self, block_ids: Iterable[int]) -> None:
        """Prefix hits took these in-flight blocks back: they will not be queued when their
        copies are taken (their K/V is whole: a copy out only reads it)."""
        for block_id in block_ids:
            del self.in_flight[block_id]

    def take(self, count: int) -> list[int]:
        """Take ``count`` host blocks: the free queue's head, then the least recently used
        host-cached ones no pending copy touches (their keys are forgotten). The caller
        has checked there are enough."""
        free = self.free
        if count <= len(free):
            return [free.popleft() for _ in range(count)]
        taken = list(free)
        free.clear()
        copied = self.copied_host_ids
        # NOTE: lazily, stopping at the last one taken: a scan of the whole host cache for
        # each demotion made a 2,048-block host tier cost 2.6 s of a 21 s trace replay.
        evicted = list(islice((h for h in self.lru if h not in copied), count - len(taken)))
        for host_id in evicted:
            self.caches[self.lru.pop(host_id)].evict(host_id)
        return taken + evicted

    def copy_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Queue the (device -> host) copies, pair by pair."""
        copying_out = self.copying_out
        for device_id in device_ids:
            copying_out[device_id] = copying_out.get(device_id, 0) + 1
        self.copied_host_ids.update(host_ids)
        self.pending_out += zip(device_ids, host_ids, strict=True)

    def copy_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Queue the (host -> device) copies, pair by pair."""
        self.copied_host_ids.update(host_ids)
        self.pending_in += zip(host_ids, device_ids, strict=True)
        self.copying_in.update(dict.fromkeys(device_ids))

    def demote(self, device_id: int, group: int, key: BlockKey) -> None:
        """Give the cached ``device_id`` a host copy under ``key`` (the most recently used);
        the caller has checked the host lacks ``key`` and has a block to take."""
        (host_id,) = self.take(1)
        self.caches[group].insert(key, host_id)
        self.lru[host_id] = group
        self.demoting[device_id] = host_id
        self.copied_host_ids.add(host_id)
        self.pending_out.append((device_id, host_id))

    def drop_moot_demotion(self, block_id: int) -> None:
        """An allocation evicted device block ``block_id``: a pending demotion of it is moot,
        so its copy is dropped, its key forgotten and its host block freed to the host free
        queue's tail. O(1) when none is pending for it, else O(pending copies)."""
        host_id = self.demoting.pop(block_id, None)
        if host_id is not None:
            self.caches[self.lru.pop(host_id)].evict(host_id)
            self.pending_out.remove((block_id, host_id))
            self.free.append(host_id)

    def copy_hits_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        """A prefix hit on host-cached blocks (in block order): queue their copies in; the
        host keeps them, now the most recently used, the chain's head last."""
        self.copy_in(host_ids, device_ids)
        for host_id in reversed(host_ids):
            self.lru.move_to_end(host_id)
        self.host_hit_blocks += len(host_ids)

    def hold_swapped(self, request_id: str, table: Table, host_ids: list[int]) -> None:
        """File ``table`` (whose blocks the caller has copied out to ``host_ids``, every
        group's in order, and released) as swapped out, and empty its device tables."""
        group_host_ids: list[list[int]] = []
        start = 0
        for held in table.group_block_ids:
            group_host_ids.append(host_ids[start : start + len(held)])
            start += len(held)
        table.set_blocks([[] for _ in table.group_block_ids])
        self.swapped[request_id] = SwappedRequest(table, group_host_ids)
        self.swapped_host_blocks += len(host_ids)
        self.swapped_out_blocks += len(host_ids)

    def resume_swapped(self, request_id: str, device_ids: list[list[int]]) -> Table:
        """The swapped-out request's table on its fresh device blocks (``device_ids``, per
        group), its copies in queued; the caller files it again."""
        swapped = self.swapped.pop(request_id)
        for host_ids, group_ids in zip(swapped.group_host_block_ids, device_ids, strict=True):
            self.copy_in(host_ids, group_ids)
        self.swapped_host_blocks -= swapped.host_blocks
        self.swapped_in_blocks += swapped.host_blocks
        swapped.table.set_blocks(device_ids)
        return swapped.table

    def release_swapped(self, request_id: str) -> list[GroupBlock]:
        """``release`` of a swapped-out request: its host blocks go to the host free queue's
        tail (group by group, last block first); returns the in-flight blocks no copy reads
        any more (``copied``)."""
        swapped = self.swapped.pop(request_id)
        self.swapped_host_blocks -= swapped.host_blocks
        self.release(b for group in swapped.group_host_block_ids for b in reversed(group))
        return self.copied()

    def reset(self) -> list[GroupBlock]:
        """Forget every host-cached key: their blocks join the host free queue's tail in
        LRU order, but one a pending copy in reads (freed when its copy is taken). Returns
        the in-flight blocks no copy reads any more (``copied``)."""
        if not self.lru:
            return []
        for cache in self.caches:
            cache.clear()
        copying_in = {host_id for host_id, _ in self.pending_in}
        released = [host_id for host_id in self.lru if host_id not in copying_in]
        self.lru.clear()
        self.release(released)
        return self.copied()

    def release(self, host_ids: Iterable[int]) -> None:
        """Free host blocks (in release order) to the host free queue's tail; a pending
        copy out into one of them is moot and is dropped."""
        released = list(host_ids)
        self.free.extend(released)
        if self.pending_out:
            gone = set(released)
            kept: list[tuple[int, int]] = []
            demoting = self.demoting
            for device_id, host_id in self.pending_out:
                if host_id not in gone:
                    kept.append((device_id, host_id))
                elif demoting.get(device_id) == host_id:
                    del demoting[device_id]
                else:
                    self._uncount(device_id)
            self.pending_out = kept

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[GroupBlock]]:
        """Hand over every pending copy (out, then in) and clear them; the host blocks the
        copies in read join the host free queue's tail. Returns the copies and the
        in-flight device blocks, now free to queue, in the order they went in flight."""
        out, back = self.pending_out, self.pending_in
        self.pending_out = []
        self.pending_in = []
        self.copying_out.clear()
        self.demoting.clear()
        self.copying_in.clear()
        self.copied_host_ids.clear()
        lru = self.lru
        self.free.extend(host_id for host_id, _ in back if host_id not in lru)
        return out, back, self.copied()

    def copied(self) -> list[GroupBlock]:
        """Take out of flight the blocks no pending copy reads or writes any more, in the
        order they went in flight. O(blocks in flight)."""
        done = [item for item in self.in_flight.items() if not self.is_copying(item[0])]
        for block_id, _ in done:
            del self.in_flight[block_id]
        return done

    def _uncount(self, device_id: int) -> None:
        count = self.copying_out[device_id] - 1
        if count:
            self.copying_out[device_id] = count
        else:
            del self.copying_out[device_id]
