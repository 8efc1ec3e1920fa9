"""The block pool: which blocks are free, who holds how many references, what to copy.

It owns the two free queues, the ref counts, the groups' prefix caches (which decide
whether a block left unreferenced is free or cached free), the pending copy-on-write
pairs and the blocks sliding windows freed until the KV pool poisons them, and it takes,
drops and queues blocks in the order ``spec.blocks`` specifies (as vLLM v1 keeps a
``BlockPool`` apart from its managers). It knows blocks, not requests, and not the host
tier: a block whose last reference it drops is handed back to the caller, which lets the
host tier keep the ones a copy still needs (``impl.host_tier``) before it queues the rest
here; it tells the one who asked (``on_evict``: the host tier) of each block an allocation
evicts. Every operation is O(blocks it moves), with no scan of the pool or the queues.
Its caches emit the KV cache events of keys gained and evicted; a reset emits its one
``AllBlocksCleared`` here.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from impl.prefix_cache import EventSink, PrefixCache
from spec import AllBlocksCleared, CachedBlock


class BlockPool:
    """``total_blocks`` block ids, free or referenced, and the prefix caches of the groups
    (``caches[g]``: group g's).

    The counters: ``group_used_blocks[g]`` blocks group g holds (once per block, however
    many tables share it), ``shared_blocks`` blocks with more than one reference, and the
    running totals ``evictions``, ``cow_copies`` and ``skipped_blocks`` (table entries
    windows released).
    """

    __slots__ = (
        "cached_free",
        "caches",
        "cow_copies",
        "event_sink",
        "evictions",
        "free",
        "group_used_blocks",
        "on_evict",
        "pending_copies",
        "pending_skipped",
        "ref_counts",
        "shared_blocks",
        "skipped_blocks",
    )

    def __init__(
        self,
        total_blocks: int,
        caches: Sequence[PrefixCache],
        event_sink: EventSink | None = None,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.event_sink = event_sink
        self.on_evict = on_evict
        self.free: deque[int] = deque(range(total_blocks))
        # NOTE: an OrderedDict, not a deque: a prefix hit takes a cached free block back
        # from anywhere in the queue, and ``del`` is O(1) there where ``deque.remove`` scans
        # (nano-vllm's scan costs 101 ms for 64 blocks among 131k free). ``popitem(last=
        # False)`` evicts the least recently freed block in O(1).
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.ref_counts: list[int] = [0] * total_blocks
        self.caches = list(caches)
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks windows made free and uncached, in order, until ``take_skipped``; a dict
        # so that an allocation taking one drops it in O(1).
        self.pending_skipped: dict[int, None] = {}
        self.group_used_blocks = [0] * len(self.caches)
        self.shared_blocks = 0
        self.evictions = 0
        self.cow_copies = 0
        self.skipped_blocks = 0

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
        self.group_used_blocks[group] += count
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
                    self.evictions += 1
                    if self.on_evict is not None:
                        self.on_evict(block_id)
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

    def hold(self, block_ids: Iterable[int], group: int) -> list[int]:
        """Add a reference to each of ``block_ids`` (prefix hits of ``group``); a cached free
        block among them leaves its queue. Returns the unreferenced ones that were in no
        queue (in flight: the host tier's to stop tracking). The caller counted them."""
        ref_counts = self.ref_counts
        unqueued: list[int] = []
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                if block_id in self.cached_free:
                    del self.cached_free[block_id]
                else:
                    unqueued.append(block_id)
                self.group_used_blocks[group] += 1
            self.add_reference(block_id)
        return unqueued

    def add_reference(self, block_id: int) -> None:
        count = self.ref_counts[block_id] + 1
        self.ref_counts[block_id] = count
        if count == 2:
            self.shared_blocks += 1

    def drop(self, block_ids: Iterable[int], group: int) -> list[int]:
        """Drop one reference from each of ``block_ids`` (of ``group``) in the order given;
        returns the blocks left with none, in that order, for the caller to ``queue`` (or
        to keep in flight). A pending copy into one of them is moot and is dropped (see
        ``spec.blocks``)."""
        ref_counts = self.ref_counts
        unreferenced: list[int]
        if not self.shared_blocks:
            # NOTE: no block has two references, so each of these had one (measured: a
            # release of 30 blocks, 8 -> 6 us).
            unreferenced = list(block_ids)
            for block_id in unreferenced:
                ref_counts[block_id] = 0
        else:
            unreferenced = []
            for block_id in block_ids:
                count = ref_counts[block_id] - 1
                ref_counts[block_id] = count
                if count == 1:
                    self.shared_blocks -= 1
                elif count == 0:
                    unreferenced.append(block_id)
        if unreferenced:
            self.group_used_blocks[group] -= len(unreferenced)
            if self.pending_copies:
                self.pending_copies = [
                    (source, destination)
                    for source, destination in self.pending_copies
                    if ref_counts[destination]
                ]
        return unreferenced

    def queue(self, block_ids: Sequence[int], group: int) -> tuple[list[int], list[int]]:
        """Put unreferenced blocks of ``group`` at the queues' tails, in order: the cached
        free queue if the group caches them, else the free queue. Returns those that went
        to each."""
        cache = self.caches[group]
        if not cache.cached_blocks:
            # NOTE: the group caches nothing (a pool without prefix caching): every block
            # is freed, none looked up (measured: a release of 30 blocks, 12 -> 8 us).
            self.free.extend(block_ids)
            return list(block_ids), []
        block_keys = cache.block_keys
        freed: list[int] = []
        cached: list[int] = []
        for block_id in block_ids:
            if block_keys[block_id] is None:
                freed.append(block_id)
            else:
                cached.append(block_id)
                self.cached_free[block_id] = None
        self.free.extend(freed)
        return freed, cached

    def add_skipped(self, block_ids: list[int]) -> None:
        """Free blocks a sliding window released: they wait for ``take_skipped``."""
        for block_id in block_ids:
            self.pending_skipped[block_id] = None

    def copy_last_block(self, block_ids: list[int], destination: int) -> None:
        """The write rule's copy: ``destination`` replaces the last block of ``block_ids``
        (shared, or cached and kept by its kind) and the pair waits for ``take_copies``; the
        caller drops the table's reference to the source (``KVCacheGroups.give_back``)."""
        self.pending_copies.append((block_ids[-1], destination))
        block_ids[-1] = destination
        self.cow_copies += 1

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
        return dropped

    def cache_view(self) -> frozenset[CachedBlock]:
        """Every (group, block id, key) the caches hold, free blocks and held ones.
        O(cached blocks x their prefix length): for a consumer's resync, not a step."""
        return frozenset(
            CachedBlock(group, block_id, key)
            for group, cache in enumerate(self.caches)
            for key, block_id in cache.prefixes()
        )

    def take_copies(self) -> list[tuple[int, int]]:
        copies = self.pending_copies
        self.pending_copies = []
        return copies

    def take_skipped(self) -> list[int]:
        skipped = list(self.pending_skipped)
        self.pending_skipped.clear()
        return skipped
