"""The prefix-cache key of a full block: its tokens, chained to the key of the block before.

The cache finds candidate blocks by hash, then confirms a hit by comparing token ids down
the chain (``same_prefix``): a hash collision can cost a comparison, never hand one
request another's K/V (the failure of vLLM advisory GHSA-rm76-4mrf-v9r8, where a hash
match alone was trusted).
"""

from collections.abc import Callable

BlockHash = Callable[[int, tuple[int, ...]], int]

ROOT_HASH = 0


def default_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Python's tuple hash of (parent hash, token ids): deterministic for ints, across runs."""
    return hash((parent_hash, token_ids))


class BlockKey:
    """A block's tokens, the key of its parent block (``None`` for a first block), a hash.

    The hash is computed once, when the key is made: each block is hashed once in the
    life of a request.
    """

    __slots__ = ("hash_value", "parent", "token_ids")

    def __init__(
        self, parent: "BlockKey | None", token_ids: tuple[int, ...], hash_value: int
    ) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.hash_value = hash_value

    def same_prefix(self, other: "BlockKey") -> bool:
        """Whether both keys stand for the same whole token prefix, compared token by token."""
        # NOTE: a loop, not recursion: a chain is as long as a prompt has blocks. Keys
        # made while walking a cached chain share parents, so this ends at once.
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
