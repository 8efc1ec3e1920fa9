"""Request tables: each request's mutable block lists, and the read-only views of them.

``Table`` is the allocator's own record of a request (one block list per KV cache group,
grown at its end, trimmed at its front by a sliding window); the views hand out the
article's snapshots (``impl.records``) and never let a caller change a table.
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import NoReturn, overload

import spec
from impl.prefix_cache import BlockKey
from impl.records import AppendedSlots, RequestBlockTable
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS, KVBlock

# A token count no request reaches: the next skip of a table no window slides.
NEVER = MAX_TOTAL_BLOCKS * MAX_BLOCK_SIZE


class Table:
    """A request's tables, one per KV cache group, and the tokens they hold.

    ``group_block_ids[g]`` lists group g's held blocks in token order, from block index
    ``skipped_blocks[g]`` on; no group skips again before the request reaches
    ``next_skip_at`` tokens. ``token_ids`` and ``keys`` are ``None`` for a request allocated
    by count; otherwise ``keys[i]`` is the prefix key of full block ``i`` (one for all
    groups), made once when the block filled, under ``cache_salt``.

    ``room`` is how many tokens an append may add changing nothing but the table's length
    (and its token ids): they land in every group's own last block, which no other table
    holds, fill no block a prefix cache would key, and no window slides. The growth path
    (``impl.groups.KVCacheGroups.grow``) sets it after every change and takes its fast case
    while it lasts; 0 sends an append down the general path.

    ``frozen()`` hands out the block ids and skips as tuples, built once per change of the
    blocks (``set_blocks``, or ``changed`` after an edit in place), so an append that opens
    no block copies nothing.
    """

    __slots__ = (
        "_frozen",
        "cache_salt",
        "group_block_ids",
        "keys",
        "next_skip_at",
        "room",
        "skipped_blocks",
        "slotless_groups",
        "token_count",
        "token_ids",
    )

    def __init__(
        self,
        group_block_ids: list[list[int]],
        token_count: int,
        token_ids: list[int] | None = None,
        keys: list[BlockKey] | None = None,
        *,
        cache_salt: str | None = None,
        slotless_groups: tuple[int, ...] = (),
    ) -> None:
        self.group_block_ids = group_block_ids
        # The groups whose blocks hold no per-token slot (a state group's: ``spec.kinds``).
        self.slotless_groups = slotless_groups
        self.skipped_blocks = [0] * len(group_block_ids)
        # With a windowed group, set by ``KVCacheGroups.set_next_skip``; else it stays NEVER.
        self.next_skip_at = NEVER
        self.token_count = token_count
        self.token_ids = token_ids
        self.keys = keys
        self.cache_salt = cache_salt
        self.room = 0
        self._frozen: tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] | None = None

    def set_blocks(self, group_block_ids: list[list[int]]) -> None:
        """Hold ``group_block_ids`` from now on (a swap's)."""
        self.group_block_ids = group_block_ids
        self._frozen = None

    def changed(self) -> None:
        """The blocks or the skips were edited in place: ``frozen`` builds them again."""
        self._frozen = None

    def frozen(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """Every group's block ids and skips, as tuples (O(blocks) once per change)."""
        frozen = self._frozen
        if frozen is None:
            frozen = self._frozen = (
                tuple(map(tuple, self.group_block_ids)),
                tuple(self.skipped_blocks),
            )
        return frozen

    def appended(
        self, request_id: str, block_size: int, new_tokens: int, cached_tokens: int
    ) -> AppendedSlots:
        """Every group's table and the slots of its last ``new_tokens`` positions: what an
        ``allocate`` or ``append`` of them gives."""
        block_ids, skipped_blocks = self._frozen or self.frozen()
        end = self.token_count
        slots: tuple[tuple[int, ...], ...]
        if new_tokens == 1:
            # The last token lies in every group's last block (no window skips it).
            # NOTE: a list, not a generator, and no ``__new__`` of the named tuple: this is
            # the decode append's whole cost (measured: 2.4 -> 1.6 us a call).
            offset = (end - 1) % block_size
            slotless_groups = self.slotless_groups
            if slotless_groups:
                slots = tuple(
                    [
                        () if group in slotless_groups else (held[-1] * block_size + offset,)
                        for group, held in enumerate(block_ids)
                    ]
                )
            else:
                slots = tuple([(held[-1] * block_size + offset,) for held in block_ids])
            return tuple.__new__(
                AppendedSlots,
                (request_id, end, block_ids, skipped_blocks, slots, cached_tokens),
            )
        slotless_groups = self.slotless_groups
        slots = tuple(
            ()
            if group in slotless_groups
            else tuple(
                held[p // block_size - skipped] * block_size + p % block_size
                for p in range(end - new_tokens, end)
            )
            for group, (held, skipped) in enumerate(zip(block_ids, skipped_blocks, strict=True))
        )
        return AppendedSlots(request_id, end, block_ids, skipped_blocks, slots, cached_tokens)

    def copy(self) -> "Table":
        """A table holding the same blocks, tokens and keys (a fork's child)."""
        child = Table(
            [list(held) for held in self.group_block_ids],
            self.token_count,
            None if self.token_ids is None else list(self.token_ids),
            None if self.keys is None else list(self.keys),
            cache_salt=self.cache_salt,
            slotless_groups=self.slotless_groups,
        )
        child.skipped_blocks = list(self.skipped_blocks)
        child.next_skip_at = self.next_skip_at
        return child

    def snapshot(self, request_id: str, group: int = 0) -> RequestBlockTable:
        """A copy of the table of ``group``, as the article's calls return it."""
        return RequestBlockTable(
            request_id,
            list(self.group_block_ids[group]),
            self.token_count,
            self.skipped_blocks[group],
        )

    def snapshots(self, request_id: str) -> tuple[spec.RequestBlockTable, ...]:
        """The table of every group, as spec's records (``tables``)."""
        block_ids, skipped = self.frozen()
        return tuple(
            spec.RequestBlockTable(request_id, held, self.token_count, group_skipped)
            for held, group_skipped in zip(block_ids, skipped, strict=True)
        )


class RequestTables(Mapping[str, RequestBlockTable]):
    """``request_tables``: a read-only live view, by request id; each read is a snapshot of
    group 0's table.

    O(1) to get and to test membership (a table read copies its block ids). Writing to it
    raises: tables change only through the manager's operations.
    """

    __slots__ = ("_tables",)

    def __init__(self, tables: dict[str, Table]) -> None:
        self._tables = tables

    def __getitem__(self, request_id: str) -> RequestBlockTable:
        return self._tables[request_id].snapshot(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __setitem__(self, request_id: str, table: RequestBlockTable) -> NoReturn:
        raise TypeError("request_tables is read-only: use allocate, append_tokens or release")

    def __delitem__(self, request_id: str) -> NoReturn:
        raise TypeError("request_tables is read-only: use allocate, append_tokens or release")

    def __repr__(self) -> str:
        return f"request_tables({dict(self)!r})"


class Blocks(Sequence[KVBlock]):
    """``blocks``: the pool's ``KVBlock`` records by id, made on demand (O(1) memory)."""

    __slots__ = ("_block_size", "_total_blocks")

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self._total_blocks = total_blocks
        self._block_size = block_size

    @overload
    def __getitem__(self, index: int) -> KVBlock: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVBlock]: ...
    def __getitem__(self, index: int | slice) -> KVBlock | list[KVBlock]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._total_blocks))]
        block_id = range(self._total_blocks)[index]  # IndexError past either end
        return KVBlock(block_id, self._block_size)

    def __len__(self) -> int:
        return self._total_blocks
