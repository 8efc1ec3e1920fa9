"""What a ``KVBlockManager`` is made of, and everything it answers without changing.

``ManagerBase`` builds the parts (``impl.block_pool``: the free and cached free queues,
ref counts, pending copies; ``impl.groups``: the KV cache groups and every table
operation across them; ``impl.tables``: each request's tables and their views;
``impl.usage``: the running counters) and holds the read-only queries: the queues, the
tables and snapshots (every group's at once for an engine step), ref counts, usage, the
prefix-cache lookup, and the mapping to spec state for tests. ``impl.manager`` adds
every operation that changes state.
"""

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import ClassVar

from impl import checking
from impl.block_pool import BlockPool
from impl.groups import KVCacheGroups
from impl.prefix_cache import BlockHash, EventSink, PrefixCache, default_block_hash
from impl.records import AppendedSlots, RequestBlockTable
from impl.tables import Blocks, RequestTables, Table
from impl.usage import UsageCounters
from spec import (
    AllocatorState,
    KVBlock,
    KVBlockUsage,
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
    duplicate_request,
    slot_index,
    unknown_request,
)


@dataclass(eq=False)
class ManagerBase:
    """The fields, the parts and the read-only queries of ``impl.KVBlockManager``.

    Only the article's two parameters are positional; ``block_hash`` (the prefix cache's
    hash of a parent hash and a block's token ids), ``group_windows`` and ``event_sink``
    are keyword-only. ``group_windows`` lists the KV cache groups that share the pool
    (``None``: full attention; W: a sliding window of W tokens); the default is one
    full-attention group, the allocator without groups. ``event_sink`` (e.g. a list's
    ``append``) is called with every KV cache event (``spec.events``) as the caches change;
    with ``None`` no event is built and the decode paths never look at it.
    ``host_blocks`` sizes the host tier ``swap_out`` copies a request to (0: none);
    ``host_prefix_cache`` demotes freed cached blocks to it (``docs/design.md``).
    """

    total_blocks: int
    block_size: int = 16
    _: KW_ONLY
    block_hash: BlockHash = field(default=default_block_hash, repr=False)
    group_windows: tuple[int | None, ...] = (None,)
    event_sink: EventSink | None = field(default=None, repr=False)
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
        if self.event_sink is not None and not callable(self.event_sink):
            raise TypeError(
                f"event_sink must be callable or None, got {type(self.event_sink).__name__} "
                f"{self.event_sink!r}"
            )
        self.group_windows = check_group_windows(self.group_windows)
        check_host_tier(self.host_blocks, self.host_prefix_cache)
        self.blocks: Sequence[KVBlock] = Blocks(self.total_blocks, self.block_size)
        self._counters = UsageCounters(len(self.group_windows))
        sink = self.event_sink
        caches = [
            self.prefix_cache_class(self.total_blocks, self.block_hash, group=g, event_sink=sink)
            for g in range(len(self.group_windows))
        ]
        self._pool = self.block_pool_class(
            self.total_blocks,
            caches,
            self._counters,
            sink,
            host_blocks=self.host_blocks,
            host_prefix_cache=self.host_prefix_cache,
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

    # -- checking ----------------------------------------------------------------------

    def to_spec(self) -> AllocatorState:
        """The spec state this allocator is in (for tests and checkers; O(pool))."""
        return checking.to_spec(self.block_size, self.group_windows, self._pool, self._tables)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming every spec invariant or counter this pool breaks."""
        checking.check_invariants(self.to_spec(), self.usage(), self._groups.caches)

    def check_indexes(self) -> None:
        """Raise ``AssertionError`` if a prefix cache's hash index disagrees with its cached
        blocks: what ``check_invariants`` adds to ``to_spec()``. A checker that has compared
        ``to_spec()`` with a spec state whose invariants hold needs only this."""
        checking.check_indexes(self._groups.caches)

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

    def _table(self, request_id: str) -> Table:
        try:
            return self._tables[request_id]
        except KeyError:
            unknown_request(request_id)

    def _check_new(self, request_id: str) -> None:
        check_request_id(request_id)
        if request_id in self._tables or request_id in self._host.swapped:
            duplicate_request(request_id)
