"""The article series' ``KVBlockManager``, as a thin layer over ``KVCacheManager``.

Code written against the article's manager runs unchanged on it: a dataclass of
``total_blocks`` and ``block_size`` a subclass extends with ``__post_init__``; ``allocate``
and ``append_tokens`` by count returning a snapshot of the request's table (the article's
mutable record, ``impl.records.RequestBlockTable``), ``release`` returning its block ids,
``snapshot_request``, ``usage``, ``request_tables`` (a read-only view), ``blocks`` and
``free_block_ids``; and pagedkv's decode hot path ``append_slot``. It has no row in
``spec.api`` and no mirror of its own: it runs the table's ``allocate`` (by count),
``append`` and ``release`` on the layer's own manager, which it never hands out, so every
request it holds was allocated by count. It skips only their result records, which it has
no use for (``allocate``'s and ``append``'s slots, built per token), by calling what they
call: ``KVCacheManager._allocate_count`` and the growth path ``KVCacheGroups.grow``.
``append_slot``'s in-block case (``Table.room``, which ``grow`` leaves to its callers) is
inlined, as ``KVCacheManager.append``'s is, because it is the article's hot path.
"""

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass

from impl.manager import KVCacheManager
from impl.records import RequestBlockTable
from impl.tables import Blocks, RequestTables, Table
from spec import (
    GroupEntry,
    KVBlock,
    KVBlockUsage,
    check_group,
    check_token_count,
    unknown_request,
)


@dataclass(eq=False)
class KVBlockManager:
    """A pool of ``total_blocks`` blocks of ``block_size`` tokens, lent to requests by count.

    Only the article's two parameters are positional; ``group_windows`` (keyword-only)
    lists the KV cache groups that share the pool, as ``KVCacheManager``'s does. A subclass
    may define ``__post_init__``, call ``super().__post_init__()`` and add attributes of its
    own.
    """

    total_blocks: int
    block_size: int = 16
    _: KW_ONLY
    group_windows: Sequence[GroupEntry] = (None,)

    def __post_init__(self) -> None:
        self._manager = KVCacheManager(
            self.total_blocks, self.block_size, group_windows=self.group_windows
        )
        self.blocks: Sequence[KVBlock] = Blocks(self.total_blocks, self.block_size)
        self._request_tables = RequestTables(self._manager._tables)

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Give a new request blocks for ``token_count`` tokens (every group's); returns
        group 0's table."""
        if type(token_count) is not int:
            check_token_count(token_count)  # by count only: token ids are refused here
        return self._manager._allocate_count(request_id, token_count).snapshot(request_id)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        """Grow a request by ``token_count`` tokens; returns a snapshot of group 0's table.

        The snapshot copies the table (O(blocks)), as the article's does; a decode loop
        that needs none should call ``append_slot`` (O(1)).
        """
        try:
            table = self._manager._tables[request_id]
        except KeyError:
            unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth here
        if type(token_count) is not int or token_count < 0:
            check_token_count(token_count)  # by count only: token ids are refused here
        if 0 < token_count <= table.room:
            # NOTE: the growth path's in-block case (``KVCacheGroups.grow``) inlined, as in
            # ``append_slot``: the article's decode step changes two counters.
            table.room -= token_count
            table.token_count += token_count
        else:
            self._manager._groups.grow(request_id, table, token_count)
        # NOTE: ``Table.snapshot`` inlined: a call is a tenth of this path.
        return RequestBlockTable(
            request_id, list(table.group_block_ids[0]), table.token_count, table.skipped_blocks[0]
        )

    def append_slot(self, request_id: str) -> int:
        """Grow a request by one token; return that token's pool slot in group 0: the row of
        the KV pool its K/V go to, ``block_id * block_size + offset``. The hot path of
        decoding: O(1), no copy. Same effect as ``append_tokens(request_id, 1)``.
        """
        try:
            table = self._manager._tables[request_id]
        except KeyError:
            unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth here
        position = table.token_count
        if table.room:
            # NOTE: the in-block case of the growth path (``KVCacheGroups.grow``) inlined:
            # a call is a third of this path. The layer's requests are all by count.
            table.room -= 1
            table.token_count = position + 1
        else:
            self._manager._groups.grow(request_id, table, 1)
        return table.group_block_ids[0][-1] * self.block_size + position % self.block_size

    def release(self, request_id: str) -> list[int]:
        """Drop a request; each block loses a reference, group by group, last block first.
        Returns the request's block ids in table order, as the article's does."""
        table = self._manager._tables.pop(request_id, None)
        if table is None:
            unknown_request(request_id)  # the layer swaps nothing out
        self._manager._groups.release(table)
        if len(table.group_block_ids) == 1:
            return table.group_block_ids[0]  # the table is gone: its own list is handed out
        return [block_id for held in table.group_block_ids for block_id in held]

    def snapshot_request(self, request_id: str, group: int = 0) -> RequestBlockTable:
        """A copy of one request's table in KV cache group ``group``; ``KeyError`` if the
        request is unknown."""
        if group != 0 or type(group) is not int:
            check_group(group, len(self.group_windows))
        return self._table(request_id).snapshot(request_id, group)

    def usage(self) -> KVBlockUsage:
        """The usage report (``KVCacheManager.usage``)."""
        return self._manager.usage()

    @property
    def request_tables(self) -> Mapping[str, RequestBlockTable]:
        """Every request's table by request id: a read-only view, O(1) per read."""
        return self._request_tables

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head first: the next allocation takes from the left."""
        return tuple(self._manager._pool.free)

    @property
    def free_blocks(self) -> int:
        """How many blocks an allocation may take (cached free ones included), in O(1)."""
        return self._manager._pool.free_blocks

    def can_allocate(self, token_count: int) -> bool:
        """Whether ``allocate`` of ``token_count`` tokens would find enough blocks now (a
        table's worth in every group)."""
        kinds = self._manager.group_windows
        needed = sum(kind.table_blocks(self.block_size, token_count) for kind in kinds)
        return needed <= self.free_blocks

    def _table(self, request_id: str) -> Table:
        try:
            return self._manager._tables[request_id]
        except KeyError:
            unknown_request(request_id)
