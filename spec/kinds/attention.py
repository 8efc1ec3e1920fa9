"""The attention kinds of KV cache group: full attention, and a sliding window of W tokens.

A table of an attention group holds one block per ``block_size`` positions, each the K/V
of those positions. A full block is cached under its salt and the whole prefix it ends
(``spec.caching``); a hit holds the cached blocks of the prefix. A sliding window's
queries read only the last W keys, so the blocks wholly before the window are released
(the window rule of ``spec.growth``); a full-attention group never releases one.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import combinations

from spec.records import CacheKey, GroupView, RequestBlockTable
from spec.rules import first_window_token, next_skip_token_count, skipped_blocks_at, slot_index


@dataclass(frozen=True, slots=True)
class FullAttention:
    """A group of full-attention layers: every query reads every key before it."""

    @property
    def name(self) -> str:
        return "full attention"

    @property
    def window(self) -> int | None:
        """The keys a query reads back (``None``: all of them)."""
        return None

    def check(self, group: int, block_size: int, host_blocks: int) -> None:
        """Refuse this group in a pool of ``block_size`` with ``host_blocks`` host blocks:
        full attention fits any."""

    def first_read(self, token_count: int) -> int:
        """The first position a query at ``token_count`` reads: 0, every key."""
        return 0

    def skipped_blocks_at(self, block_size: int, computed_tokens: int) -> int:
        """The leading blocks of a table that no query at or past ``computed_tokens`` reads:
        none."""
        return 0

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int | None:
        """The least computed length at which a table skipping ``skipped_blocks`` blocks
        skips one more: never (``None``)."""
        return None

    def table_blocks(self, block_size: int, token_count: int) -> int:
        """The blocks a table of ``token_count`` tokens spans, skipped ones included."""
        return -(-token_count // block_size)

    def hit_keys(
        self, block_size: int, token_ids: tuple[int, ...], hit_tokens: int, cache_salt: str | None
    ) -> tuple[CacheKey, ...]:
        """The keys a prefix hit of ``hit_tokens`` tokens needs cached: those of its full
        blocks from the first a query past the hit reads, in index order."""
        first = self.skipped_blocks_at(block_size, hit_tokens)
        return tuple(
            CacheKey(cache_salt, token_ids[: (index + 1) * block_size])
            for index in range(first, hit_tokens // block_size)
        )

    def keyed_block_indices(
        self, block_size: int, first_index: int, skipped_blocks: int, token_count: int
    ) -> range:
        """The block indices, from ``first_index`` on, that a table of ``token_count``
        tracked tokens caches under their prefix: its full blocks it still holds."""
        return range(max(first_index, skipped_blocks), token_count // block_size)

    def is_checkpoint_at(self, computed_tokens: int) -> bool:
        """Whether an adding operation at ``computed_tokens`` first caches the running
        block: never, in an attention group (it caches full blocks instead)."""
        return False

    def rewrites_last_block(self, block_size: int, computed_tokens: int) -> bool:
        """Whether tokens added at ``computed_tokens`` write into the table's last block:
        when it is partly filled."""
        return computed_tokens % block_size != 0

    def copies_before_write(self, shared: bool, cached: bool) -> bool:
        """Whether a write into the last block copies it first: when another table holds
        it. A cached one only this table holds forgets its key instead (``spec.growth``)."""
        return shared

    def check_truncate(
        self, group: int, request_id: str, held_tokens: int, token_count: int
    ) -> None:
        """Refuse to truncate a table of ``held_tokens`` to ``token_count``: an attention
        group may drop its tail (its window's check is ``spec.errors.check_truncate``)."""

    def slots(self, block_size: int, table: RequestBlockTable, positions: range) -> tuple[int, ...]:
        """Where the K/V of each of ``positions`` lives in the pool (``spec.rules``)."""
        return tuple(
            slot_index(block_size, table.block_ids, p, table.skipped_blocks) for p in positions
        )

    def is_table_sized(self, block_size: int, table: RequestBlockTable) -> bool:
        """A table holds ceil(token_count / block_size) - skipped_blocks blocks."""
        return (
            table.token_count >= 0
            and table.skipped_blocks >= 0
            and table.skipped_blocks + len(table.block_ids)
            == self.table_blocks(block_size, table.token_count)
        )

    def invariants(self) -> Mapping[str, Callable[[GroupView], bool]]:
        """The named invariants of an attention group (``spec.invariants``)."""
        return ATTENTION_INVARIANTS


@dataclass(frozen=True, slots=True)
class SlidingWindow(FullAttention):
    """A group of layers whose queries read the last ``window`` keys (W >= 1)."""

    window: int  # FullAttention's read-only ``window``, here a field

    @property
    def name(self) -> str:
        return f"window {self.window}"

    def check(self, group: int, block_size: int, host_blocks: int) -> None:
        """Refuse a window that is not an ``int`` (TypeError, ``bool`` too) of at least 1
        token (ValueError)."""
        if type(self.window) is not int:
            raise TypeError(
                f"window of group {group} must be an int, "
                f"got {type(self.window).__name__} {self.window!r}"
            )
        if self.window < 1:
            raise ValueError(f"window of group {group} must be at least 1 token, got {self.window}")

    def first_read(self, token_count: int) -> int:
        """max(0, token_count - W + 1): a query at q reads keys q - W + 1 .. q
        (``spec.rules.first_window_token``)."""
        return first_window_token(token_count, self.window)

    def skipped_blocks_at(self, block_size: int, computed_tokens: int) -> int:
        """The whole blocks before ``first_read(computed_tokens)`` (the window rule of
        ``spec.growth``)."""
        return skipped_blocks_at(block_size, computed_tokens, self.window)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int | None:
        """(skipped_blocks + 1) * block_size + W - 1 (``spec.rules``)."""
        return next_skip_token_count(block_size, skipped_blocks, self.window)


def is_cached_content_exact(view: GroupView) -> bool:
    """A cached block in a table sits where its key ends, and the table's tokens equal the
    key, or begin it where the table ends in that block (a rollback kept the key:
    ``spec.releasing.truncate``)."""
    prefix_of = {block_id: key for key, block_id in view.cache.items()}
    for request_id, table in view.tables.items():
        ids = view.token_ids.get(request_id)
        for index, block_id in enumerate(table.block_ids, start=table.skipped_blocks):
            key = prefix_of.get(block_id)
            if key is None:
                continue
            if ids is None or len(key.token_ids) != (index + 1) * view.block_size:
                return False
            if ids != key.token_ids[: len(ids)] and ids[: len(key.token_ids)] != key.token_ids:
                return False
    return True


def is_shared_only_over_a_common_prefix(view: GroupView) -> bool:
    """Two tables share a block only at the same index, over the same content before it.

    The same content is the same tokens where both tables track them: two requests may
    reach a shared block through different blocks holding equal tokens (a prefix hit
    after one of them computed a duplicate of a cached block). Where either is tracked by
    count, the only way to share is a fork, so the blocks before must be the very same
    (where both still hold them). Indices are block indices: a table's ``block_ids[i]`` is
    index ``skipped_blocks + i``.
    """
    return all(
        _is_shared_soundly(view, first, second)
        for first, second in combinations(view.tables.values(), 2)
    )


def _is_shared_soundly(
    view: GroupView, first: RequestBlockTable, second: RequestBlockTable
) -> bool:
    common = set(first.block_ids) & set(second.block_ids)
    if not common:
        return True
    first_index = {b: first.skipped_blocks + i for i, b in enumerate(first.block_ids)}
    second_index = {b: second.skipped_blocks + i for i, b in enumerate(second.block_ids)}
    if any(first_index[b] != second_index[b] for b in common):
        return False
    depth = max(first_index[b] for b in common) + 1
    first_ids = view.token_ids.get(first.request_id)
    second_ids = view.token_ids.get(second.request_id)
    if first_ids is None or second_ids is None:
        # Both hold the blocks from the later of their skipped_blocks on.
        start = max(first.skipped_blocks, second.skipped_blocks)
        return (
            first.block_ids[start - first.skipped_blocks : depth - first.skipped_blocks]
            == second.block_ids[start - second.skipped_blocks : depth - second.skipped_blocks]
        )
    end = min(depth * view.block_size, len(first_ids), len(second_ids))
    return first_ids[:end] == second_ids[:end]


ATTENTION_INVARIANTS: Mapping[str, Callable[[GroupView], bool]] = {
    "cached_content_exact": is_cached_content_exact,
    "shared_over_common_prefix": is_shared_only_over_a_common_prefix,
}
