"""The kinds of KV cache group in impl: for each kind of ``spec.kinds``, the object
``impl.groups`` and ``impl.prefix_hits`` ask what its rule says for a table, and the
registry that builds it (``impl_kinds``).

Each holds its spec kind (``spec``) and answers in impl's terms: which leading blocks no
query reads any more and when a table skips next (a sliding window's); which checkpoint
an append makes (a state group's); which part of a prompt's cached blocks a hit of so
many blocks holds in the group. The arithmetic they share with the spec is the spec
kind's. A new kind is a class here, subclassing the one whose rules it keeps, and its
line in ``IMPL_KINDS``.
"""

from collections.abc import Mapping

from impl.prefix_cache import BlockKey, PrefixCache
from impl.tables import NEVER, Table
from spec.kinds import FullAttention, GroupKind, RecurrentState, SlidingWindow

# A group's part of a prefix hit: its device blocks, and its blocks on the host only
# ((block index, host block) each).
HitPart = tuple[list[int], list[tuple[int, int]]]


class FullAttentionGroup:
    """A group of full-attention layers: every query reads every key, nothing is skipped,
    and a prefix hit needs each of its blocks (a miss ends the hit search)."""

    __slots__ = ("spec",)

    # Whether each position has a slot in the group's blocks (a state group's has none).
    has_slots = True
    # Whether a hit needs every block before it cached here, so a miss ends the search.
    needs_every_block = True
    # Whether a table grows by a block per ``block_size`` tokens (the engine's fast case).
    grows_by_token = True
    # Whether an append may first cache the table's running block (``checkpoint_key``).
    checkpoints = False

    def __init__(self, kind: GroupKind) -> None:
        self.spec = kind

    def table_blocks(self, block_size: int, token_count: int) -> int:
        """The blocks a table of ``token_count`` tokens spans, skipped ones included (the
        spec kind's ``table_blocks``): ceil(token_count / block_size)."""
        # NOTE: the spec kind's arithmetic inlined, not called: a call is a third of a
        # growing append's work per group (two groups: 2.2 -> 2.65 us a decode call).
        return -(-token_count // block_size)

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

    def hit_part(
        self,
        block_size: int,
        found: list[int | None],
        on_host: dict[int, int],
        run: list[int],
        hit_blocks: int,
    ) -> HitPart | None:
        """This group's part of a hit of ``hit_blocks`` blocks, or None if it does not
        allow one: every block from the first a query past the hit reads, each cached on
        the device (``found[i]``) or on the host only (``on_host[i]``; ``run[i]``: how
        many indices up to i are cached in either)."""
        first = self.skip_target(block_size, hit_blocks * block_size)
        if run[hit_blocks - 1] < hit_blocks - first:
            return None
        return (
            [b for b in found[first:hit_blocks] if b is not None],
            [(i, on_host[i]) for i in range(first, hit_blocks) if found[i] is None],
        )


class SlidingWindowGroup(FullAttentionGroup):
    """A group of layers with a sliding window of ``window`` tokens: a hit needs only the
    blocks its window reads, so a miss before them does not end the search."""

    __slots__ = ()

    needs_every_block = False

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return self.spec.skipped_blocks_at(block_size, computed_tokens)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        skip_at = self.spec.next_skip_at(block_size, skipped_blocks)
        assert skip_at is not None, "a sliding window has a width"
        return skip_at


class RecurrentStateGroup(FullAttentionGroup):
    """A group of recurrent state layers (``spec.kinds.recurrent_state``): it never skips,
    its tables hold one block each, checkpointed every ``interval`` tokens, and a hit
    needs the checkpoint at exactly its length."""

    __slots__ = ("interval",)

    has_slots = False
    needs_every_block = False
    grows_by_token = False
    checkpoints = True

    def __init__(self, kind: GroupKind) -> None:
        super().__init__(kind)
        assert isinstance(kind, RecurrentState), "a state group's kind"
        self.interval = kind.interval

    def table_blocks(self, block_size: int, token_count: int) -> int:
        return self.spec.table_blocks(block_size, token_count)

    def checkpoint_key(self, table: Table, token_count: int, cache: PrefixCache) -> BlockKey | None:
        """The checkpoint rule: at least one token, token ids tracked, the table's length
        L0 on the grid and no block cached under its first L0 tokens yet; the key is that
        of its last full block (L0 ends on a block boundary)."""
        position = table.token_count
        if not token_count or table.keys is None or not self.spec.is_checkpoint_at(position):
            return None
        key = table.keys[len(table.keys) - 1]
        if cache.find(key) is not None:
            return None
        return key

    def hit_part(
        self,
        block_size: int,
        found: list[int | None],
        on_host: dict[int, int],
        run: list[int],
        hit_blocks: int,
    ) -> HitPart | None:
        """The checkpoint at exactly the hit (``found[i]``: the checkpoint after block
        index i, or None), never from the host."""
        block_id = found[hit_blocks - 1]
        return None if block_id is None else ([block_id], [])


# The impl class of each spec kind (a test's planted bug may swap one).
IMPL_KINDS: Mapping[type, type[FullAttentionGroup]] = {
    FullAttention: FullAttentionGroup,
    SlidingWindow: SlidingWindowGroup,
    RecurrentState: RecurrentStateGroup,
}


def impl_kinds(
    kinds: tuple[GroupKind, ...], classes: Mapping[type, type[FullAttentionGroup]]
) -> list[FullAttentionGroup]:
    """The impl object of each kind of ``kinds``, of the class ``classes`` names for it."""
    return [classes[type(kind)](kind) for kind in kinds]
