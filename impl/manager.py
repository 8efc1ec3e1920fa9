"""The fast, mutable block allocator an engine calls on every step: the article's API.

``KVBlockManager`` is the front: it checks every argument, refuses before it changes
anything, and hands the work to the parts that each own one thing:
- ``impl.block_pool``: the free and cached free queues, ref counts, pending copies;
- ``impl.groups``: the KV cache groups (full attention or a sliding window) and every
  table operation across them (growth, the window rule, the prefix-cache hit);
- ``impl.tables``: each request's tables and the read-only views of them;
- ``impl.usage``: the running counters behind ``usage()``;
- ``impl.checking``: the mapping to spec state and ``check_invariants`` (for tests).

It behaves exactly like ``spec.allocator`` (same block ids, same queue orders, same
errors) and is tested against it in lockstep. What it adds is speed: O(1) amortised per
operation, with no scan of the pool, the queues or the tables on any hot path. The decode
appends of a table whose tokens land in its own last block are inlined here.

It is *not* the owner of KV tensors: it hands out block ids (and, for copy-on-write, the
copies to make; for windows, the blocks to poison), and harness/ decides what lives in them.
"""

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import ClassVar

from impl import checking, swap
from impl.block_pool import BlockPool
from impl.groups import KVCacheGroups
from impl.prefix_cache import BlockHash, BlockKey, PrefixCache, default_block_hash
from impl.records import AppendedSlots, PromptAllocation, RequestBlockTable, SwapCopies
from impl.tables import Blocks, RequestTables, Table
from impl.usage import UsageCounters
from spec import (
    MAX_TOKEN_ID,
    AllocatorState,
    BlockAllocationError,
    HostBlockAllocationError,
    KVBlock,
    KVBlockUsage,
    ReleasedBlocks,
    SwappedOut,
    allocated_by_count,
    awaits_copy,
    blocks_for_request,
    blocks_for_tokens,
    check_block_id,
    check_cache_salt,
    check_group,
    check_group_windows,
    check_host_tier,
    check_new_tokens,
    check_pool_shape,
    check_request_id,
    check_token_count,
    check_token_ids,
    check_truncate,
    duplicate_request,
    first_window_token,
    not_swapped,
    slot_index,
    tracks_token_ids,
    unknown_request,
)


@dataclass(eq=False)
class KVBlockManager:
    """A pool of ``total_blocks`` blocks of ``block_size`` tokens, lent to requests.

    A dataclass, as in the article: a subclass may define ``__post_init__``, call
    ``super().__post_init__()`` and add attributes of its own. Only the article's two
    parameters are positional; ``block_hash`` (the prefix cache's hash of a parent hash
    and a block's token ids) and ``group_windows`` are keyword-only. ``group_windows`` lists the
    KV cache groups that share the pool (``None``: full attention; W: a sliding window of
    W tokens); the default is one full-attention group, the allocator without groups.
    ``host_blocks`` sizes the host tier that ``swap_out`` copies a request to (0: none).
    """

    total_blocks: int
    block_size: int = 16
    _: KW_ONLY
    block_hash: BlockHash = field(default=default_block_hash, repr=False)
    group_windows: tuple[int | None, ...] = (None,)
    host_blocks: int = 0
    host_prefix_cache: bool = False

    # The parts a subclass may swap for its own (the planted bugs of the tests do).
    prefix_cache_class: ClassVar[type[PrefixCache]] = PrefixCache
    block_pool_class: ClassVar[type[BlockPool]] = BlockPool
    groups_class: ClassVar[type[KVCacheGroups]] = KVCacheGroups

    def __post_init__(self) -> None:
        check_pool_shape(self.total_blocks, self.block_size)
        if not callable(self.block_hash):
            raise TypeError(
                f"block_hash must be callable, got {type(self.block_hash).__name__} "
                f"{self.block_hash!r}"
            )
        self.group_windows = check_group_windows(self.group_windows)
        check_host_tier(self.host_blocks, self.host_prefix_cache)
        self.blocks: Sequence[KVBlock] = Blocks(self.total_blocks, self.block_size)
        self._counters = UsageCounters(len(self.group_windows))
        caches = [
            self.prefix_cache_class(self.total_blocks, self.block_hash) for _ in self.group_windows
        ]
        self._pool = self.block_pool_class(
            self.total_blocks, caches, self._counters, self.host_blocks, self.host_prefix_cache
        )
        self._host = self._pool.host
        self._groups = self.groups_class(
            self.block_size, self.group_windows, self._pool, self.block_hash
        )
        self._tables: dict[str, Table] = {}
        self._request_tables = RequestTables(self._tables)
        # A request allocated by count in a pool of one full-attention group holds its
        # blocks alone until a fork: its decode appends and release take a fast path.
        self._exclusive_tables = self.group_windows == (None,)
        # Whether any group slides a window: only then does a new table need its next skip.
        self._windowed = any(window is not None for window in self.group_windows)
        # The pool's ref counts (one list for the pool's life), for the in-block decode paths.
        self._ref_counts = self._pool.ref_counts

    # -- read-only views (copies; not for the hot path) -------------------------------

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head first: the next allocation takes from the left."""
        return tuple(self._pool.free)

    @property
    def cached_free_block_ids(self) -> tuple[int, ...]:
        """Free blocks that still hold a cached prefix, least recently freed first."""
        return tuple(self._pool.cached_free)

    @property
    def request_tables(self) -> Mapping[str, RequestBlockTable]:
        """Every request's table by request id: a read-only view, O(1) per read."""
        return self._request_tables

    @property
    def free_blocks(self) -> int:
        """How many blocks an allocation may take (cached free ones included), in O(1)."""
        return self._pool.free_blocks

    @property
    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """Copy-on-write copies (source block, destination block) not yet taken."""
        return tuple(self._pool.pending_copies)

    def can_allocate(self, token_count: int) -> bool:
        """Whether ``allocate`` of ``token_count`` tokens would find enough blocks now (a
        table's worth in every group)."""
        needed = blocks_for_request(self.block_size, token_count, len(self.group_windows))
        return needed <= self._pool.free_blocks

    def snapshot_request(self, request_id: str, group: int = 0) -> RequestBlockTable:
        """A copy of one request's table in KV cache group ``group``; ``KeyError`` if the
        request is unknown."""
        if group != 0 or type(group) is not int:
            check_group(group, len(self.group_windows))
        return self._table(request_id).snapshot(request_id, group)

    def snapshot_groups(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        """A copy of the request's table in every KV cache group, group 0's first."""
        table = self._table(request_id)
        return tuple(table.snapshot(request_id, g) for g in range(len(table.group_block_ids)))

    def new_token_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        """Every group's table and the slots of the request's last ``token_count`` tokens
        (e.g. the first chunk ``allocate_prompt`` gave, past its hit); changes nothing."""
        check_token_count(token_count)
        table = self._table(request_id)
        check_new_tokens(request_id, token_count, table.token_count)
        return self._appended_slots(request_id, table, token_count)

    def ref_count(self, block_id: int) -> int:
        """How many tables hold ``block_id``; an id outside the pool is refused."""
        if type(block_id) is not int or not 0 <= block_id < self.total_blocks:
            check_block_id(block_id, self.total_blocks)
        return self._pool.ref_counts[block_id]

    def usage(self) -> KVBlockUsage:
        """The usage report, from running counters in O(1)."""
        return self._counters.report(
            self.total_blocks,
            self.block_size,
            self._pool.free_blocks,
            len(self._tables),
            sum(cache.cached_blocks for cache in self._groups.caches),
            host=self._host,
        )

    # -- operations --------------------------------------------------------------------

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Give a new request blocks for ``token_count`` tokens whose ids are not tracked,
        in every group (group 0's first); returns group 0's table."""
        per_group = self._blocks_for(token_count)
        needed = blocks_for_request(self.block_size, token_count, len(self.group_windows))
        self._check_new(request_id)
        available = self._pool.free_blocks
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        groups = range(len(self.group_windows))
        table = Table(
            [self._pool.take(per_group, group) for group in groups],
            token_count,
            exclusive=self._exclusive_tables,
        )
        if self._windowed:
            self._groups.set_next_skip(table)
        self._tables[request_id] = table
        self._counters.allocated_tokens += token_count
        return table.snapshot(request_id)

    def allocate_prompt(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> PromptAllocation:
        """Give a new request blocks for its prompt, reusing the longest prefix cached under
        its ``cache_salt`` (``None``: no salt, a namespace of its own).

        Hits never cover the prompt's last token. Every block the prompt fills is cached
        under its salt.
        """
        self._check_new(request_id)
        ids = tuple(token_ids)
        check_token_ids(ids)
        check_cache_salt(cache_salt)
        cached_tokens, group_hits, group_host_hits, keys = self._groups.match(ids, cache_salt)
        pool = self._pool
        per_group = blocks_for_tokens(self.block_size, len(ids)) - cached_tokens // self.block_size
        needed = per_group * len(self.group_windows) + sum(map(len, group_host_hits))
        cached_free = pool.cached_free  # an in-flight hit is unreferenced but not free
        revived = sum(1 for hits in group_hits for b in hits if b in cached_free)
        available = pool.free_blocks - revived
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        # Every block is hashed before anything changes: a hash that raises changes nothing.
        self._groups.caches[0].extend_keys(ids, keys, self.block_size, cache_salt)
        for group, hits in enumerate(group_hits):
            pool.revive(hits, group)
        if any(group_host_hits):
            held = self._held_after_host_hits(
                cached_tokens, group_hits, group_host_hits, keys, per_group
            )
        else:
            held = [hits + pool.take(per_group, group) for group, hits in enumerate(group_hits)]
        table = Table(held, len(ids), list(ids), keys, cache_salt=cache_salt)
        self._groups.set_skipped(table, cached_tokens)
        self._tables[request_id] = table
        self._counters.allocated_tokens += len(ids)
        self._counters.prefix_hit_tokens += cached_tokens
        self._groups.cache_full_blocks(table, cached_tokens // self.block_size)
        return PromptAllocation(table.snapshot(request_id), cached_tokens)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        """Grow a request allocated by count by ``token_count`` tokens; returns a snapshot.

        The snapshot copies the table (O(blocks)), as the article's does; a decode loop
        that needs no snapshot should call ``append_slot`` (O(1)).
        """
        if type(token_count) is not int or token_count < 0:
            check_token_count(token_count)
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        position = table.token_count
        if table.exclusive and token_count <= -position % self.block_size:
            # NOTE: the article's decode step inlined: the tokens fit in the request's own
            # last block, so nothing but counts changes (measured: 1.4 -> 0.6 us a call).
            table.token_count = position + token_count
            self._counters.allocated_tokens += token_count
            return RequestBlockTable(
                request_id, list(table.group_block_ids[0]), position + token_count
            )
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, token_count)
        return table.snapshot(request_id)

    def append_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        """``append_tokens``, returning what the step needs: every group's table and the
        new tokens' slots in each (O(blocks + tokens added))."""
        check_token_count(token_count)
        table = self._table(request_id)
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, token_count)
        return self._appended_slots(request_id, table, token_count)

    def append_token_id_slots(self, request_id: str, token_ids: Sequence[int]) -> AppendedSlots:
        """``append_token_ids``, returning what the step needs: every group's table and the
        new tokens' slots in each."""
        ids = tuple(token_ids)
        table = self._add_token_ids(request_id, ids)
        return self._appended_slots(request_id, table, len(ids))

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> RequestBlockTable:
        """Grow a request allocated by ``allocate_prompt`` by these tokens; returns a snapshot.

        Every block the new tokens fill becomes cached.
        """
        return self._add_token_ids(request_id, tuple(token_ids)).snapshot(request_id)

    def _add_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> Table:
        table = self._table(request_id)
        if table.token_ids is None:
            allocated_by_count(request_id)
        check_token_ids(token_ids)
        assert table.keys is not None, "a table with token ids has keys"
        first_index = table.token_count // self.block_size
        # Hashed before anything changes: a hash that raises changes nothing.
        new_keys = self._groups.caches[0].next_keys(
            table.token_ids, table.keys, token_ids, self.block_size, table.cache_salt
        )
        self._groups.grow(request_id, table, len(token_ids))
        table.token_ids.extend(token_ids)
        table.keys.extend(new_keys)
        self._groups.cache_full_blocks(table, first_index)
        return table

    def append_slot(self, request_id: str) -> int:
        """Grow a request allocated by count by one token; return that token's pool slot.

        The hot path of decoding: O(1), no copy. The slot is ``block_id * block_size +
        offset``, the row of the KV pool the new token's K/V go to. Same effect on the
        allocator as ``append_tokens(request_id, 1)``.
        """
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth here
        position = table.token_count
        block_size = self.block_size
        offset = position % block_size
        if offset and table.exclusive:
            # NOTE: the decode fast path, ``spec.slot_index`` of the last token inlined: the
            # token lands in the request's own last block.
            table.token_count = position + 1
            self._counters.allocated_tokens += 1
            return table.group_block_ids[0][-1] * block_size + offset
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, 1)
        return table.group_block_ids[0][-1] * block_size + offset

    def append_token_slot(self, request_id: str, token_id: int) -> int:
        """Grow a request allocated by ``allocate_prompt`` by one token; return its slot.

        The hot path of decoding with prefix caching; O(1) but when the token fills a
        block, which is then hashed and cached. Same effect as ``append_token_ids``.
        """
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        token_ids = table.token_ids
        if token_ids is None:
            allocated_by_count(request_id)
        if type(token_id) is not int or not 0 <= token_id <= MAX_TOKEN_ID:
            check_token_ids((token_id,))
        position = table.token_count
        block_size = self.block_size
        offset = position % block_size
        block_ids = table.group_block_ids[0]
        keys = table.keys
        assert keys is not None, "a table with token ids has keys"
        new_keys = None
        if offset == block_size - 1:
            # The token fills its block: hashed before anything changes, so that a hash
            # that raises changes nothing.
            new_keys = self._groups.caches[0].next_keys(
                token_ids, keys, (token_id,), block_size, table.cache_salt
            )
        if offset and self._exclusive_tables and self._ref_counts[block_ids[-1]] == 1:
            # NOTE: the fast case of ``KVCacheGroups.grow`` inlined for one full-attention
            # group (a call is a third of this path): the token lands in the request's own
            # last block.
            table.token_count = position + 1
            self._counters.allocated_tokens += 1
        else:
            self._groups.grow(request_id, table, 1)  # opens a block or copies a shared one
        token_ids.append(token_id)
        if new_keys is not None:
            keys.extend(new_keys)
            self._groups.cache_full_blocks(table, position // block_size)
        return block_ids[-1] * block_size + offset

    def fork(self, parent_id: str, child_id: str) -> RequestBlockTable:
        """Give ``child_id`` a table sharing every block of ``parent_id``; O(blocks).

        Takes no block. Whichever side later appends into a shared, partly filled last
        block gets a copy of it first (see ``take_copies``).
        """
        parent = self._table(parent_id)
        self._check_new(child_id)
        child = Table(
            [list(held) for held in parent.group_block_ids],
            parent.token_count,
            None if parent.token_ids is None else list(parent.token_ids),
            None if parent.keys is None else list(parent.keys),
            cache_salt=parent.cache_salt,
        )
        child.skipped_blocks = list(parent.skipped_blocks)
        child.next_skip_at = parent.next_skip_at
        self._tables[child_id] = child
        for held in parent.group_block_ids:
            for block_id in held:
                self._pool.add_reference(block_id)
        parent.exclusive = child.exclusive = False
        self._counters.allocated_tokens += parent.token_count
        return child.snapshot(child_id)

    def release(self, request_id: str) -> list[int]:
        """Drop a request; each block loses a reference, last block first. Returns the
        request's block ids in table order, as the article's does.

        A block left unreferenced joins the tail of the cached free queue if it holds a
        cached prefix, else the tail of the free queue. ``release_blocks`` does the same
        and also says which blocks became free.
        """
        table = self._tables.get(request_id)
        if table is None or not table.exclusive:  # a swapped-out request too
            return list(self.release_blocks(request_id).block_ids)
        del self._tables[request_id]
        self._counters.allocated_tokens -= table.token_count
        block_ids = table.group_block_ids[0]  # exclusive: one group, so every block
        self._pool.release_exclusive(block_ids)
        return block_ids  # the table is gone: its own list can be handed out

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        """``release``, reporting which of the request's blocks became free, and where to:
        every group's blocks, group 0's first, each group's last block first. A swapped-out
        request's host blocks are freed (it holds no device block)."""
        table = self._tables.get(request_id)
        if table is None:
            if request_id in self._host.swapped:
                return swap.release_swapped(self._pool, request_id)
            unknown_request(request_id)
        del self._tables[request_id]
        self._counters.allocated_tokens -= table.token_count
        return self._groups.release(table)

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Shrink a request to its first ``token_count`` tokens (the rollback of rejected
        speculative tokens); returns a snapshot. O(blocks dropped).

        The blocks wholly past the new length are dropped as ``release`` drops them; a
        cached full block left partly filled stops being cached (see ``spec.truncate``).
        """
        self.truncate_blocks(request_id, token_count)
        return self._tables[request_id].snapshot(request_id)

    def truncate_blocks(self, request_id: str, token_count: int) -> ReleasedBlocks:
        """``truncate``, reporting the blocks it dropped (every group's, group 0's first, in
        table order) and which of them became free or cached free (group by group, last
        first), as ``release_blocks`` reports a whole table. The engine poisons
        ``freed_block_ids`` after rolling back rejected drafts."""
        if type(token_count) is not int or token_count < 0:
            check_token_count(token_count)
        table = self._table(request_id)
        check_truncate(
            request_id,
            token_count,
            table.token_count,
            block_size=self.block_size,
            group_windows=self.group_windows,
            skipped_blocks=table.skipped_blocks,
            first_reads=[first_window_token(token_count, w) for w in self.group_windows],
        )
        self._counters.allocated_tokens -= table.token_count - token_count
        return self._groups.truncate(table, token_count)

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many tokens of ``token_ids`` ``allocate_prompt`` would find cached under
        ``cache_salt`` (the hit rule of ``spec.cached_prefix_tokens``); changes nothing.

        A chunked prefill asks this over the whole prompt before allocating its first
        chunk (``allocate_prompt(token_ids[:hit + chunk])`` then finds the same hit).
        """
        ids = tuple(token_ids)
        check_token_ids(ids)
        check_cache_salt(cache_salt)
        cached_tokens, _, _, _ = self._groups.match(ids, cache_salt)
        return cached_tokens

    def preempt(self, request_id: str) -> ReleasedBlocks:
        """Release a request the engine preempts to recompute later; counts the preemption."""
        released = self.release_blocks(request_id)
        self._counters.preemptions += 1
        return released

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``spec.reset_prefix_cache``): cached free blocks
        become plain free blocks at the free queue's tail, in their queue order; held
        blocks keep their K/V but no later prompt hits them. Never refused; returns how
        many cached blocks were dropped. O(pool): for a weight reload, not a step."""
        return self._pool.reset_caches()

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (source, destination) to perform now, in order; clears them.

        The engine copies each source block's K/V to its destination before the step's
        forward pass writes into the destination.
        """
        return self._pool.take_copies()

    def take_skipped_blocks(self) -> list[int]:
        """The blocks sliding windows made free and uncached since the last call, in the
        order they were released; clears them. The engine poisons their K/V: nothing may
        read it again. A block an allocation took meanwhile is not among them."""
        return self._pool.take_skipped()

    # -- the host tier: preemption by swap ---------------------------------------------

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

    # -- checking ----------------------------------------------------------------------

    def to_spec(self) -> AllocatorState:
        """The spec state this allocator is in (for tests and checkers; O(pool))."""
        return checking.to_spec(self.block_size, self.group_windows, self._pool, self._tables)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming every spec invariant or counter this pool breaks."""
        checking.check_invariants(self.to_spec(), self.usage(), self._groups.caches)

    # -- building blocks ----------------------------------------------------------------

    def _blocks_for(self, token_count: int) -> int:
        return blocks_for_tokens(self.block_size, token_count)

    def _appended_slots(self, request_id: str, table: Table, token_count: int) -> AppendedSlots:
        block_size = self.block_size
        end = table.token_count
        return AppendedSlots(
            tuple(table.snapshot(request_id, g) for g in range(len(table.group_block_ids))),
            tuple(
                tuple(
                    slot_index(block_size, held, p, skipped) for p in range(end - token_count, end)
                )
                for held, skipped in zip(table.group_block_ids, table.skipped_blocks, strict=True)
            ),
        )

    def _held_after_host_hits(
        self,
        cached_tokens: int,
        group_hits: list[list[int]],
        group_host_hits: list[list[tuple[int, int]]],
        keys: list[BlockKey],
        per_group: int,
    ) -> list[list[int]]:
        """Each group's blocks of a prompt whose hit is partly on the host only, group by
        group: the host hits take their device blocks (copies in queued), then the blocks
        past the hit are taken; held in block index order with the device hits."""
        held: list[list[int]] = []
        for group, (hits, host_hits) in enumerate(zip(group_hits, group_host_hits, strict=True)):
            revived = self._pool.revive_from_host(group, host_hits, keys)
            from_host = dict(zip((index for index, _ in host_hits), revived, strict=True))
            first = self._groups.groups[group].skip_target(self.block_size, cached_tokens)
            device_hits = iter(hits)
            row = [
                from_host[index] if index in from_host else next(device_hits)
                for index in range(first, cached_tokens // self.block_size)
            ]
            held.append(row + self._pool.take(per_group, group))
        return held

    def _table(self, request_id: str) -> Table:
        try:
            return self._tables[request_id]
        except KeyError:
            unknown_request(request_id)

    def _check_new(self, request_id: str) -> None:
        check_request_id(request_id)
        if request_id in self._tables or request_id in self._host.swapped:
            duplicate_request(request_id)
