"""``KVCacheManager``: the fast, mutable allocator an engine calls on every step, one method
per row of ``spec.api.OPERATIONS``.

Each method checks every argument and refuses before it changes anything, then hands the
work to the parts it is made of, each owning one thing: the tables (``impl.tables``), the
KV cache groups and every table operation across them (``impl.groups``: growth, release,
truncation), a prompt's prefix hit (``impl.prefix_hits``), the device pool
(``impl.block_pool``) and, beside it, the host tier (``impl.host_tier``); ``impl.checking``
maps it to a spec state (for tests).

It behaves exactly like the spec (same block ids, same queue orders, same errors) and is
tested against it in lockstep. What it adds is speed: O(1) amortised per operation, with
no scan of the pool, the queues or the tables on any hot path; a decode ``append`` that
opens no block changes one table's length and copies nothing. It is *not* the owner of
KV tensors: it hands out block ids and slots, and the copies and freed blocks the KV pool
must handle (``take_transfers``); harness/ decides what lives in them. The article
series' API is ``impl.article.KVBlockManager``, a thin layer over this one that calls its
public methods only: the rows, and beside them a seam of its own, by count and without
the rows' slots (``allocate_tokens``, ``append_tokens``, ``append_slot``,
``request_tables``, ``free_blocks``).
"""

from collections.abc import Mapping, Sequence
from typing import ClassVar

from impl import checking, records
from impl.block_pool import BlockPool
from impl.events import PendingEvents
from impl.groups import KVCacheGroups
from impl.host_tier import HostTier
from impl.prefix_cache import (
    BlockHash,
    EventSink,
    PrefixCache,
    check_hooks,
    default_block_hash,
)
from impl.prefix_hits import PrefixHits
from impl.records import AppendedSlots
from impl.tables import RequestTables, Table
from impl.usage import usage_report
from spec import (
    MAX_TOKEN_ID,
    AllocatorState,
    BlockAllocationError,
    CachedBlock,
    KVBlockUsage,
    ReleasedBlocks,
    RequestBlockTable,
    Transfers,
    errors,
)
from spec.kinds import GroupEntry, group_kinds


class KVCacheManager:
    """A pool of ``total_blocks`` blocks of ``block_size`` tokens, lent to requests.

    Keyword-only: ``group_windows`` lists the KV cache groups that share the pool, by
    their kinds (``spec.kinds``: ``None`` or ``FullAttention()``; W or ``SlidingWindow(W)``,
    a window of W tokens; ``RecurrentState(C)``, a state group checkpointed every C
    tokens; the default is one full-attention group), held as kinds;
    ``block_hash`` is the prefix cache's hash of a parent hash and a
    block's token ids; ``event_sink`` (e.g. a list's ``append``) is called with every KV
    cache event (``spec.events``) once its call is done, and with ``None`` no event is built;
    ``host_blocks`` sizes the host tier ``swap_out`` copies a request to (0: none) and
    ``host_prefix_cache`` demotes freed cached blocks to it (``docs/design.md``); the host
    cache's events (of host block ids) go to ``host_event_sink``, a reset's to ``event_sink``.
    """

    # The parts a subclass may swap for its own (the planted bugs of the tests do).
    prefix_cache_class: ClassVar[type[PrefixCache]] = PrefixCache
    block_pool_class: ClassVar[type[BlockPool]] = BlockPool
    groups_class: ClassVar[type[KVCacheGroups]] = KVCacheGroups
    host_tier_class: ClassVar[type[HostTier]] = HostTier
    prefix_hits_class: ClassVar[type[PrefixHits]] = PrefixHits

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: Sequence[GroupEntry] = (None,),
        block_hash: BlockHash = default_block_hash,
        event_sink: EventSink | None = None,
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
        host_event_sink: EventSink | None = None,
    ) -> None:
        errors.check_pool_shape(total_blocks, block_size)
        check_hooks(block_hash, event_sink, host_event_sink)
        errors.check_host_tier(host_blocks, host_prefix_cache)
        windows = group_kinds(group_windows, block_size, host_blocks)
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.group_windows = windows
        self.block_hash = block_hash
        self.event_sink = event_sink
        self.host_blocks = host_blocks
        self.host_prefix_cache = host_prefix_cache
        groups = range(len(windows))
        # Each call delivers its own events when it is done.
        self._events = PendingEvents(event_sink, host_event_sink)
        emit, emit_host = self._events.emit, self._events.emit_host
        caches = [
            self.prefix_cache_class(total_blocks, block_hash, group=g, event_sink=emit)
            for g in groups
        ]
        host_caches = [
            self.prefix_cache_class(host_blocks, block_hash, group=g, event_sink=emit_host)
            for g in groups
        ]
        self._host = self.host_tier_class(host_blocks, host_caches if host_prefix_cache else ())
        moot = self._host.drop_moot_demotion if host_prefix_cache else None
        self._pool = self.block_pool_class(total_blocks, caches, emit, moot)
        self._groups = self.groups_class(block_size, windows, self._pool, self._host, block_hash)
        self._hits = self.prefix_hits_class(self._groups, block_hash)
        self._tables: dict[str, Table] = {}
        self._prefix_hit_tokens = 0
        self._preemptions = 0

    # -- admission and growth ---------------------------------------------------------

    def allocate(
        self, request_id: str, tokens: int | Sequence[int], cache_salt: str | None = None
    ) -> AppendedSlots:
        """Give a new request blocks for ``tokens`` in every group (group 0's first): a
        count (its blocks are never cached), or token ids, reusing the longest prefix
        cached under ``cache_salt`` and caching every block they fill. Returns every
        group's table and the slots of the tokens past the hit."""
        if errors.is_token_ids(tokens):
            self._check_new(request_id)
            ids = tuple(tokens)
            errors.check_token_ids(ids)
            errors.check_cache_salt(cache_salt)
            return self._allocate_token_ids(request_id, ids, cache_salt)
        table = self._allocate_count(request_id, tokens, cache_salt)
        return self._appended(request_id, table, table.token_count, 0)

    def _allocate_count(
        self, request_id: str, tokens: object, cache_salt: str | None = None
    ) -> Table:
        """``allocate`` by count without its result record (``allocate_tokens``'s too)."""
        self._check_new(request_id)
        errors.check_token_count(tokens)
        if cache_salt is not None:
            errors.check_cache_salt(cache_salt)
            errors.counted_with_salt(request_id)
        assert isinstance(tokens, int)  # narrowed by check_token_count
        table = self._groups.new_table(request_id, tokens)
        self._tables[request_id] = table
        return table

    def _allocate_token_ids(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None
    ) -> AppendedSlots:
        table, cached_tokens = self._hits.allocate(request_id, token_ids, cache_salt)
        self._groups.set_skipped(table, cached_tokens)
        self._hits.cache_full_blocks(table, cached_tokens // self.block_size)
        self._tables[request_id] = table
        self._prefix_hit_tokens += cached_tokens
        return self._appended(request_id, table, len(token_ids) - cached_tokens, cached_tokens)

    def append(self, request_id: str, tokens: int | Sequence[int] = 1) -> AppendedSlots:
        """Grow a request by ``tokens`` (one token by default): a count for a request
        allocated by count, token ids for one allocated by token ids (the blocks they fill
        get cached). Returns every group's table and the new tokens' slots: what one
        engine step needs of it.

        O(1) when the tokens land in every group's own last block (``Table.room``), else
        O(blocks taken, skipped or hashed)."""
        try:
            table = self._tables[request_id]
        except KeyError:
            errors.unknown_request(request_id)
        if type(tokens) is int:
            if table.token_ids is not None:
                errors.tracks_token_ids(request_id, tokens)
            if 0 < tokens <= table.room:
                # NOTE: the growth path's in-block case (``KVCacheGroups.grow``) inlined:
                # the decode append of a request allocated by count, one call less.
                table.room -= tokens
                table.token_count += tokens
                return table.appended(request_id, self.block_size, tokens, 0)
            if tokens < 0:
                errors.check_token_count(tokens)
            self._groups.grow(request_id, table, tokens)
            return self._appended(request_id, table, tokens, 0)
        if not errors.is_token_ids(tokens):
            if table.token_ids is not None:
                errors.tracks_token_ids(request_id, tokens)
            errors.check_token_count(tokens)  # not an int: refused
        if table.token_ids is None:
            errors.allocated_by_count(request_id, len(tokens))  # type: ignore[arg-type]
        ids = tuple(tokens)  # type: ignore[arg-type]  # is_token_ids narrowed it
        for token_id in ids:
            if type(token_id) is not int or not 0 <= token_id <= MAX_TOKEN_ID:
                errors.check_token_ids(ids)
        self._add_token_ids(request_id, table, ids)
        return self._appended(request_id, table, len(ids), 0)

    def _add_token_ids(self, request_id: str, table: Table, token_ids: tuple[int, ...]) -> None:
        assert table.token_ids is not None and table.keys is not None, "a tracked table"
        count = len(token_ids)
        if 0 < count <= table.room:
            table.room -= count
            table.token_count += count
            table.token_ids.extend(token_ids)
            return
        block_size = self.block_size
        first_index = table.token_count // block_size
        # Hashed before anything changes: a hash that raises changes nothing.
        new_keys = self._pool.caches[0].next_keys(
            table.token_ids, table.keys, token_ids, block_size, table.cache_salt
        )
        self._groups.grow(request_id, table, count)
        table.token_ids.extend(token_ids)
        table.keys.extend(new_keys)
        self._hits.cache_full_blocks(table, first_index)

    def _appended(
        self, request_id: str, table: Table, new_tokens: int, cached_tokens: int
    ) -> AppendedSlots:
        """Every group's table and the slots of its last ``new_tokens`` positions."""
        appended = table.appended(request_id, self.block_size, new_tokens, cached_tokens)
        events = self._events
        return events.delivered(appended) if events.events or events.host_events else appended

    # -- sharing, release and preemption ------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> tuple[RequestBlockTable, ...]:
        """Give ``child_id`` a table sharing every block of ``parent_id`` in every group;
        returns the child's tables. O(blocks). Takes no block: whichever side later appends
        into a shared, partly filled last block gets a copy of it first."""
        parent = self._table(parent_id)
        self._check_new(child_id)
        child = self._tables[child_id] = self._groups.fork(parent)
        return child.snapshots(child_id)

    def truncate(self, request_id: str, token_count: int) -> ReleasedBlocks:
        """Shrink a request to its first ``token_count`` tokens (the rollback of rejected
        speculative tokens): the blocks wholly past it are dropped as ``release`` drops
        them, a cached full block left partly filled stops being cached. Reports the
        dropped blocks, those that became free, and the stale slots of each group's kept
        last block. O(blocks dropped)."""
        if type(token_count) is not int or token_count < 0:
            errors.check_token_count(token_count)
        table = self._table(request_id)
        errors.check_truncate(
            request_id,
            token_count,
            table.token_count,
            block_size=self.block_size,
            group_windows=self.group_windows,
            skipped_blocks=table.skipped_blocks,
        )
        return self._events.delivered(self._groups.truncate(table, token_count))

    def release(self, request_id: str) -> ReleasedBlocks:
        """Drop a request; each block loses a reference, group by group, last block first.
        Reports its blocks in table order and which became free or cached free. A
        swapped-out request's host blocks are freed (it holds no device block)."""
        return self._release(request_id)

    def preempt(self, request_id: str) -> ReleasedBlocks:
        """``release`` of a request the engine preempts to recompute later; counted."""
        released = self._release(request_id)
        self._preemptions += 1
        return released

    def _release(self, request_id: str) -> ReleasedBlocks:
        table = self._tables.pop(request_id, None)
        if table is not None:
            freed, cached = self._groups.release(table)
            block_ids = [block_id for held in table.group_block_ids for block_id in held]
            released = ReleasedBlocks(tuple(block_ids), tuple(freed), tuple(cached))
            return self._events.delivered(released)  # the host prefix cache's demotions
        if request_id not in self._host.swapped:
            errors.unknown_request(request_id)
        freed, cached = self._groups.queue_copied(self._host.release_swapped(request_id))
        return self._events.delivered(ReleasedBlocks((), tuple(freed), tuple(cached)))

    # -- the host tier ------------------------------------------------------------------

    def swap_out(self, request_id: str) -> ReleasedBlocks:
        """Copy every block the request holds (every group's; skipped ones are not held) to
        the host tier and drop its references as ``release`` does; the request is swapped
        out until ``swap_in`` or ``release``. Reports its blocks and those that will be free
        or cached free once ``take_transfers`` hands their copies over. O(blocks + copies
        pending).

        Refused while a pending copy writes into one of its blocks (``ValueError``: take the
        transfers first) and when the host tier is absent or short (``HostBlockAllocationError``).
        """
        table = self._table(request_id)
        self._groups.check_swap_out(request_id, table)
        del self._tables[request_id]
        return self._events.delivered(self._groups.copy_to_host(request_id, table))

    def swap_in(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        """Give a swapped-out request fresh device blocks (sharing is not restored) and queue
        the copies from its host blocks; returns every group's table. O(blocks).

        Refused when the device is short (``BlockAllocationError``)."""
        swapped = self._host.swapped.get(request_id)
        if swapped is None:
            errors.not_swapped(request_id)
        needed = swapped.host_blocks
        available = self._pool.free_blocks
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        table = self._tables[request_id] = self._groups.copy_from_host(request_id, swapped)
        return self._events.delivered(table.snapshots(request_id))

    def take_transfers(self) -> Transfers:
        """What the KV pool must do before the next forward, in order, and clears it: every
        copy to the host, every copy-on-write copy, every copy from the host, then the
        blocks sliding windows made free and uncached (to poison). The device blocks that
        were in flight then join the queues."""
        device_to_host, host_to_device, copied = self._host.take_copies()
        transfers = Transfers(
            tuple(device_to_host),
            tuple(self._pool.take_copies()),
            tuple(host_to_device),
            tuple(self._pool.take_skipped()),
        )
        self._groups.queue_copied(copied)
        return self._events.delivered(transfers)

    # -- the prefix cache ---------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``spec.reset_prefix_cache``): cached free blocks
        become plain free blocks at the free queue's tail, in their queue order; held
        blocks keep their K/V but no later prompt hits them. Never refused; returns how
        many cached blocks were dropped. O(pool): for a weight reload, not a step."""
        dropped = self._pool.reset_caches()
        self._groups.queue_copied(self._host.reset())
        return self._events.delivered(dropped)

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many tokens of ``token_ids`` ``allocate`` would find cached under
        ``cache_salt`` (the hit rule of ``spec.caching``); changes nothing.

        A chunked prefill asks this over the whole prompt before allocating its first
        chunk (``allocate(token_ids[:hit + chunk])`` then finds the same hit).
        """
        ids = errors.check_prompt(token_ids)
        errors.check_cache_salt(cache_salt)
        cached_tokens, _, _, _ = self._hits.match(ids, cache_salt)
        return cached_tokens

    # -- queries ------------------------------------------------------------------------

    def cache_view(self) -> frozenset[CachedBlock]:
        """Every (group, block id, key) the device's prefix caches hold: what replaying
        every KV cache event gives, for a consumer that missed some to resync from."""
        return self._pool.cache_view()

    def tables(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        """The request's table in every KV cache group, group 0's first; ``KeyError`` if it
        holds no device blocks. O(groups), a block list copied once per change."""
        return self._table(request_id).snapshots(request_id)

    def usage(self) -> KVBlockUsage:
        """The usage report: the pool's and the host tier's counters in O(1), the tables'
        tokens and blocks in O(requests x groups)."""
        return usage_report(
            self.block_size,
            self.total_blocks,
            pool=self._pool,
            host=self._host,
            tables=self._tables.values(),
            prefix_hit_tokens=self._prefix_hit_tokens,
            preemptions=self._preemptions,
        )

    # -- by count, group 0's table: the article layer's seam -----------------------------
    # ``impl.article.KVBlockManager`` allocates every request by count and hands out group
    # 0's table or slot. ``allocate`` and ``append`` would build every group's slots of
    # every token they add (O(tokens) for a prompt, most of a decode append), which it has
    # no use for: these run the same operations, refuse the same calls and build only
    # what it returns. They take a count only (token ids are refused, as the article's
    # calls refuse them) and keep no state of their own.

    def allocate_tokens(self, request_id: str, token_count: int) -> records.RequestBlockTable:
        """``allocate(request_id, token_count)`` by count; returns a snapshot of group 0's
        table (the article's record, O(blocks)) instead of the slots."""
        table = self._allocate_count(request_id, token_count)
        return self._events.delivered(table.snapshot(request_id))  # the cached blocks taken

    def append_tokens(self, request_id: str, token_count: int = 1) -> records.RequestBlockTable:
        """``append(request_id, token_count)`` by count; returns a snapshot of group 0's
        table (O(blocks)) instead of the slots. A decode loop that needs no table calls
        ``append_slot`` (O(1))."""
        try:
            table = self._tables[request_id]
        except KeyError:
            errors.unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth
        if table.token_ids is not None:
            errors.tracks_token_ids(request_id, token_count)
        if type(token_count) is not int or token_count < 0:
            errors.check_token_count(token_count)
        if 0 < token_count <= table.room:
            # NOTE: the in-block case, as in ``append_slot`` and not through it: a call there
            # costs this path a third (measured: 0.49 -> 0.65 us a call).
            table.room -= token_count
            table.token_count += token_count
        else:
            self._groups.grow(request_id, table, token_count)
            self._events.delivered(None)  # the cached blocks it took, once it has grown
        # NOTE: ``Table.snapshot`` inlined: a call is a tenth of this path.
        return records.RequestBlockTable(
            request_id, list(table.group_block_ids[0]), table.token_count, table.skipped_blocks[0]
        )

    def append_slot(self, request_id: str) -> int:
        """``append(request_id, 1)`` by count; returns the new token's slot in group 0 alone
        (``slots[0][0]``: ``block_id * block_size + offset``), so a token that opens no
        block costs a dict lookup and two counters: O(1), nothing built."""
        try:
            table = self._tables[request_id]
        except KeyError:
            errors.unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth
        if table.token_ids is not None:
            errors.tracks_token_ids(request_id, 1)
        position = table.token_count
        if table.room:
            # NOTE: the growth path's in-block case (``KVCacheGroups.grow``) inlined, as in
            # ``append``: a call is a third of this path. ``append`` keeps its own: a shared
            # helper would cost the engine's decode call a call too.
            table.room -= 1
            table.token_count = position + 1
        else:
            self._groups.grow(request_id, table, 1)
            events = self._events
            if events.events or events.host_events:
                events.delivered(None)  # the cached blocks it took, once it has grown
        return table.group_block_ids[0][-1] * self.block_size + position % self.block_size

    @property
    def request_tables(self) -> Mapping[str, records.RequestBlockTable]:
        """Every running request's table in group 0, by request id: a read-only live view,
        O(1) to get (a read copies its block ids); ``tables`` gives every group's."""
        return RequestTables(self._tables)

    @property
    def free_blocks(self) -> int:
        """How many blocks an allocation may take now, cached free ones included
        (``usage().free_blocks``), in O(1)."""
        return self._pool.free_blocks

    # -- checking -----------------------------------------------------------------------

    def to_spec(self) -> AllocatorState:
        """The spec state this allocator is in (for tests and checkers; O(pool))."""
        return checking.to_spec(
            self.block_size,
            self.group_windows,
            pool=self._pool,
            host=self._host,
            tables=self._tables,
            prefix_hit_tokens=self._prefix_hit_tokens,
            preemptions=self._preemptions,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming every spec invariant or counter this pool breaks,
        or a prefix cache whose hash index disagrees with its cached blocks."""
        checking.check_invariants(self.to_spec(), self.usage(), self._pool.caches)

    def _check_new(self, request_id: str) -> None:
        """Refuse ``request_id`` for a new request: not a request id, or one in use."""
        errors.check_request_id(request_id)
        if request_id in self._tables or request_id in self._host.swapped:
            errors.duplicate_request(request_id)

    def _table(self, request_id: str) -> Table:
        try:
            return self._tables[request_id]
        except KeyError:
            errors.unknown_request(request_id)
