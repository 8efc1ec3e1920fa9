"""The article series' ``KVBlockManager``, as a thin layer over ``KVCacheManager``.

Code written against the article's manager runs unchanged on it: a dataclass of
``total_blocks`` and ``block_size`` a subclass extends with ``__post_init__``; ``allocate``
and ``append_tokens`` by count returning a snapshot of the request's table (the article's
mutable record, ``impl.records.RequestBlockTable``), ``release`` returning its block ids,
``snapshot_request``, ``usage``, ``request_tables`` (a read-only view), ``blocks`` and
``free_block_ids``; and pagedkv's decode hot path ``append_slot``. It has no row in
``spec.api`` and no mirror of its own: every call is a call of the one table (``allocate``,
``append``, ``release``) on the layer's own manager, which it never hands out, so every
request it holds was allocated by count. Only ``append_slot``'s in-block case is inlined
(it is the growth path's first case, ``Table.room``), because it is the article's hot path.
"""

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass

from impl.manager import KVCacheManager
from impl.records import RequestBlockTable
from impl.tables import Blocks, RequestTables
from spec import (
    KVBlock,
    KVBlockUsage,
    blocks_for_request,
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
    group_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        self._manager = KVCacheManager(
            self.total_blocks, self.block_size, group_windows=self.group_windows
        )
        self.group_windows = self._manager.group_windows
        self.blocks: Sequence[KVBlock] = Blocks(self.total_blocks, self.block_size)
        self._request_tables = RequestTables(self._manager._tables)

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Give a new request blocks for ``token_count`` tokens (every group's); returns
        group 0's table."""
        if type(token_count) is not int:
            check_token_count(token_count)  # by count only: token ids are refused here
        self._manager.allocate(request_id, token_count)
        return self.snapshot_request(request_id)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        """Grow a request by ``token_count`` tokens; returns a snapshot of group 0's table.

        The snapshot copies the table (O(blocks)), as the article's does; a decode loop
        that needs none should call ``append_slot`` (O(1)).
        """
        if type(token_count) is not int:
            check_token_count(token_count)  # by count only: token ids are refused here
        appended = self._manager.append(request_id, token_count)
        return RequestBlockTable(
            request_id,
            list(appended.block_ids[0]),
            appended.token_count,
            appended.skipped_blocks[0],
        )

    def append_slot(self, request_id: str) -> int:
        """Grow a request by one token; return that token's pool slot in group 0: the row of
        the KV pool its K/V go to, ``block_id * block_size + offset``. The hot path of
        decoding: O(1), no copy. Same effect as ``append_tokens(request_id, 1)``.
        """
        try:
            table = self._manager._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        if table.room:
            # NOTE: the in-block case of the growth path (``KVCacheGroups.grow``) inlined:
            # a call is a third of this path. The layer's requests are all by count.
            table.room -= 1
            position = table.token_count
            table.token_count = position + 1
            return table.group_block_ids[0][-1] * self.block_size + position % self.block_size
        return self._manager.append(request_id, 1).slots[0][0]

    def release(self, request_id: str) -> list[int]:
        """Drop a request; each block loses a reference, group by group, last block first.
        Returns the request's block ids in table order, as the article's does."""
        return list(self._manager.release(request_id).block_ids)

    def snapshot_request(self, request_id: str, group: int = 0) -> RequestBlockTable:
        """A copy of one request's table in KV cache group ``group``; ``KeyError`` if the
        request is unknown."""
        if group != 0 or type(group) is not int:
            check_group(group, len(self.group_windows))
        try:
            table = self._manager._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        return table.snapshot(request_id, group)

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
        needed = blocks_for_request(self.block_size, token_count, len(self.group_windows))
        return needed <= self.free_blocks
