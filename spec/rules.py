"""The arithmetic of a paged KV cache, each rule written once.

spec, impl and harness all import these: how many blocks tokens fill, where a token's K/V
lives in the pool, and which tokens a sliding window still reads. Pure functions of ints,
no state; the allocator's operations (``spec.growth``, ``spec.releasing``, ...) are built on them.
"""

from collections.abc import Sequence

from spec.errors import check_token_count


def blocks_for_tokens(block_size: int, token_count: int) -> int:
    """The number of blocks that ``token_count`` tokens occupy: ceil(token_count / block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    check_token_count(token_count)
    return -(-token_count // block_size)


def slot_index(
    block_size: int, block_ids: Sequence[int], position: int, skipped_blocks: int = 0
) -> int:
    """Where token ``position`` of a request lives in the pool: block_id * block_size + offset.

    ``block_ids`` and ``skipped_blocks`` are one group's table: ``block_ids[0]`` holds block
    index ``skipped_blocks``. A position in a skipped block has no slot (ValueError).
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if position < skipped_blocks * block_size:
        raise ValueError(
            f"position {position} lies in the first {skipped_blocks} blocks, "
            "which the sliding window released"
        )
    return block_ids[position // block_size - skipped_blocks] * block_size + position % block_size


def first_window_token(token_count: int, window: int | None) -> int:
    """The first position that a query at position ``token_count`` (the next token) reads:
    max(0, token_count - W + 1) with a window of W tokens (a query at q reads keys
    q - W + 1 .. q), 0 with full attention (``window`` None)."""
    if window is None:
        return 0
    return max(0, token_count - window + 1)


def skipped_blocks_at(block_size: int, token_count: int, window: int | None) -> int:
    """How many leading blocks of a table no query at a position at or past ``token_count``
    reads: the whole blocks before ``first_window_token`` (0 with full attention)."""
    return first_window_token(token_count, window) // block_size


def blocks_for_request(block_size: int, token_count: int, group_count: int) -> int:
    """The blocks a new request of ``token_count`` tokens takes: a table's worth in each of
    ``group_count`` KV cache groups (nothing is skipped before a token is computed)."""
    return blocks_for_tokens(block_size, token_count) * group_count


def next_skip_token_count(block_size: int, skipped_blocks: int, window: int | None) -> int | None:
    """The least computed length L0 at which a table of a group with ``window`` that skips
    ``skipped_blocks`` blocks skips one more: the first L0 with
    ``skipped_blocks_at(L0) > skipped_blocks``, (skipped_blocks + 1) * block_size + W - 1;
    ``None`` with full attention (it never skips)."""
    if window is None:
        return None
    return (skipped_blocks + 1) * block_size + window - 1
