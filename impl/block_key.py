"""The prefix-cache key of a full block: its tokens, chained to the key of the block before.

Two keys are equal only when their whole token prefixes are equal, compared token by
token down the chain; the hash only picks the dict bucket. So a hash collision can cost
a comparison, never hand one request another's K/V (the failure of vLLM advisory
GHSA-rm76-4mrf-v9r8, where a hash match alone was trusted).
"""

from collections.abc import Callable

BlockHash = Callable[[int, tuple[int, ...]], int]

ROOT_HASH = 0


def default_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Python's tuple hash of (parent hash, token ids): deterministic for ints, across runs."""
    return hash((parent_hash, token_ids))


class BlockKey:
    """A block's tokens and the key of its parent block (``None`` for a prompt's first block).

    The hash is computed once, when the key is made: each block is hashed once in the
    life of a request.
    """

    __slots__ = ("hash_value", "parent", "token_ids")

    def __init__(self, parent: "BlockKey | None", token_ids: tuple[int, ...], hash_value: int):
        self.parent = parent
        self.token_ids = token_ids
        self.hash_value = hash_value

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        # NOTE: a loop, not recursion: a chain is as long as a prompt has blocks.
        mine: BlockKey | None = self
        theirs: BlockKey | None = other
        while mine is not theirs:
            if mine is None or theirs is None or mine.token_ids != theirs.token_ids:
                return False
            mine, theirs = mine.parent, theirs.parent
        return True

    def prefix(self) -> tuple[int, ...]:
        """The whole token prefix this key stands for (O(chain); for tests and checks)."""
        parts: list[tuple[int, ...]] = []
        key: BlockKey | None = self
        while key is not None:
            parts.append(key.token_ids)
            key = key.parent
        return tuple(token for part in reversed(parts) for token in part)


def child_key(
    parent: BlockKey | None, token_ids: tuple[int, ...], block_hash: BlockHash
) -> BlockKey:
    """The key of a block holding ``token_ids`` after the block keyed ``parent``."""
    parent_hash = ROOT_HASH if parent is None else parent.hash_value
    return BlockKey(parent, token_ids, block_hash(parent_hash, token_ids))
