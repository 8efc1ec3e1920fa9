"""The article series' API over ``KVCacheManager``: code written against the article's
``KVBlockManager`` runs unchanged on pagedkv.

That is its one job, the article's shape: a dataclass of ``total_blocks`` and
``block_size`` a subclass extends with ``__post_init__``; ``allocate`` and ``append_tokens``
by count returning a snapshot of the request's table (the article's mutable record,
``impl.records.RequestBlockTable``), ``release`` returning its block ids,
``snapshot_request``, ``usage``, ``request_tables`` (a read-only view), ``blocks`` and
``free_block_ids``; and pagedkv's decode hot path ``append_slot``. It is *not* an
allocator: no row in ``spec.api``, no mirror, no state of its own. It owns a manager it
never hands out and reaches it through that manager's public methods alone: the rows
``release`` and ``usage``, the queries ``tables`` and ``to_spec``, and the seam the manager
keeps for this layer, the rows' work by count without their slots
(``KVCacheManager.allocate_tokens``, ``append_tokens``, ``append_slot``, ``request_tables``,
``free_blocks``). The in-block case of an append is written there, not here.
"""

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass

from impl.manager import KVCacheManager
from impl.records import RequestBlockTable
from impl.tables import Blocks
from spec import (
    GroupEntry,
    KVBlock,
    KVBlockUsage,
    check_group,
    check_token_count,
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
        self._request_tables = self._manager.request_tables
        # NOTE: the two appends are the manager's own methods, bound here, not calls
        # through this layer: a call is a fifth of the in-block ``append_slot`` (measured:
        # 225 -> 255 ns a call). A subclass that overrides one keeps its override, and
        # reaches the manager through the method here (``super()``).
        if type(self).append_slot is KVBlockManager.append_slot:
            self.append_slot = self._manager.append_slot  # type: ignore[method-assign]
        if type(self).append_tokens is KVBlockManager.append_tokens:
            self.append_tokens = self._manager.append_tokens  # type: ignore[method-assign]

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Give a new request blocks for ``token_count`` tokens (every group's); returns
        group 0's table."""
        if type(token_count) is not int:
            check_token_count(token_count)  # by count only: token ids are refused here
        return self._manager.allocate_tokens(request_id, token_count)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        """Grow a request by ``token_count`` tokens; returns a snapshot of group 0's table.

        The snapshot copies the table (O(blocks)), as the article's does; a decode loop
        that needs none should call ``append_slot`` (O(1)).
        """
        return self._manager.append_tokens(request_id, token_count)

    def append_slot(self, request_id: str) -> int:
        """Grow a request by one token; return that token's pool slot in group 0: the row of
        the KV pool its K/V go to, ``block_id * block_size + offset``. The hot path of
        decoding: O(1), no copy. Same effect as ``append_tokens(request_id, 1)``.
        """
        return self._manager.append_slot(request_id)

    def release(self, request_id: str) -> list[int]:
        """Drop a request; each block loses a reference, group by group, last block first.
        Returns the request's block ids in table order, as the article's does."""
        return list(self._manager.release(request_id).block_ids)

    def snapshot_request(self, request_id: str, group: int = 0) -> RequestBlockTable:
        """A copy of one request's table in KV cache group ``group``; ``KeyError`` if the
        request is unknown."""
        if group != 0 or type(group) is not int:
            check_group(group, len(self.group_windows))
        table = self._manager.tables(request_id)[group]
        return RequestBlockTable(
            request_id, list(table.block_ids), table.token_count, table.skipped_blocks
        )

    def usage(self) -> KVBlockUsage:
        """The usage report (``KVCacheManager.usage``)."""
        return self._manager.usage()

    @property
    def request_tables(self) -> Mapping[str, RequestBlockTable]:
        """Every request's table by request id: a read-only view, O(1) per read."""
        return self._request_tables

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head first: the next allocation takes from the left. O(pool): for
        tests and reports."""
        return self._manager.to_spec().free_block_ids

    @property
    def free_blocks(self) -> int:
        """How many blocks an allocation may take (cached free ones included), in O(1)."""
        return self._manager.free_blocks

    def can_allocate(self, token_count: int) -> bool:
        """Whether ``allocate`` of ``token_count`` tokens would find enough blocks now (a
        table's worth in every group)."""
        kinds = self._manager.group_windows
        needed = sum(kind.table_blocks(self.block_size, token_count) for kind in kinds)
        return needed <= self.free_blocks
