"""The kinds of KV cache group (``spec.kinds``), each a small object ``impl.groups`` asks
what its rule says for a table: which leading blocks no query reads any more (a sliding
window's), and when it skips next; which checkpoint an append makes (a state group's).
"""

from impl.prefix_cache import BlockKey, PrefixCache
from impl.tables import NEVER, Table
from spec import GroupKind, RecurrentState, skipped_blocks_at
from spec.kinds import is_checkpoint_at
from spec.rules import next_skip_token_count


class FullAttentionGroup:
    """A group of full-attention layers: every query reads every key, nothing is skipped.
    ``interval`` is 0 in every attention group (a state group's checkpoint interval)."""

    __slots__ = ("interval", "window")

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.interval = 0

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        """``spec.compute_skipped_blocks``: the leading blocks of a table no query at or past
        ``computed_tokens`` reads."""
        return 0

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        """The least computed length at which a table skipping ``skipped_blocks`` skips more."""
        return NEVER

    def checkpoint_key(self, table: Table, token_count: int, cache: PrefixCache) -> BlockKey | None:
        """The key under which an append of ``token_count`` tokens to ``table`` caches its
        running block first in this group's ``cache``, or None: an attention group never
        does."""
        return None


class SlidingWindowGroup(FullAttentionGroup):
    """A group of layers with a sliding window of ``window`` tokens."""

    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return skipped_blocks_at(block_size, computed_tokens, self.window)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        skip_at = next_skip_token_count(block_size, skipped_blocks, self.window)
        assert skip_at is not None, "a sliding window has a width"
        return skip_at


class RecurrentStateGroup(FullAttentionGroup):
    """A group of recurrent state layers (``spec.kinds``): it never skips, and its tables
    hold one block each, checkpointed every ``interval`` tokens."""

    __slots__ = ()

    def __init__(self, interval: int) -> None:
        super().__init__(None)
        self.interval = interval

    def checkpoint_key(self, table: Table, token_count: int, cache: PrefixCache) -> BlockKey | None:
        """The checkpoint rule of ``spec.kinds``: at least one token, token ids tracked, the
        table's length L0 on the grid and no block cached under its first L0 tokens yet;
        the key is that of its last full block (L0 ends on a block boundary)."""
        position = table.token_count
        if not token_count or table.keys is None or not is_checkpoint_at(self.interval, position):
            return None
        key = table.keys[len(table.keys) - 1]
        if cache.find(key) is not None:
            return None
        return key


def group_kind(
    window: GroupKind,
    full_attention: type[FullAttentionGroup],
    sliding_window: type[SlidingWindowGroup],
    recurrent_state: type[RecurrentStateGroup],
) -> FullAttentionGroup:
    """The group object of one entry of ``group_windows``, of the classes given (a planted
    bug may swap one)."""
    if window is None:
        return full_attention()
    if isinstance(window, RecurrentState):
        return recurrent_state(window.interval)
    return sliding_window(window)
