"""The spec's arithmetic helpers and the impl's, as pairs of pure wrappers to compare.

Each ``spec_*`` / ``impl_*`` pair computes one thing both ways: the blocks a token count
needs, the slot of a request's next token, whether that token opens a block. The impl side
goes through ``KVCacheManager`` and the article's ``KVBlockManager`` over it, since its
arithmetic lives inside their methods.
The wrappers bound their inputs (and raise the same error outside the bounds) so that a
symbolic search is finite.

Compared by Hypothesis in tests/allocator/test_helpers_symbolic.py and by ``crosshair diffbehavior``
in scripts/crosshair_check.sh. This module imports nothing but spec and impl: CrossHair
refuses to load modules whose imports have side effects (Hypothesis' do).
"""

import spec
from impl import KVBlockManager, KVCacheManager

# Slots and block openings: every pool shape up to these bounds.
MAX_BLOCK_SIZE = 4
MAX_POSITION = 15
MAX_REUSED_BLOCKS = 2
# Blocks for a token count: wide bounds, the arithmetic is solved symbolically. Both ends
# are bounded because an error message formats the argument, and formatting a symbolic int
# makes CrossHair try its values one by one.
COUNT_RANGE = range(-1, 4097)


def _check_domain(block_size: int, position: int, reused_blocks: int) -> None:
    if not (
        1 <= block_size <= MAX_BLOCK_SIZE
        and 0 <= position <= MAX_POSITION
        and 0 <= reused_blocks <= MAX_REUSED_BLOCKS
    ):
        raise ValueError("outside the checked domain")


def _check_count_domain(block_size: int, token_count: int) -> None:
    if block_size not in COUNT_RANGE or token_count not in COUNT_RANGE:
        raise ValueError("outside the checked domain")


def spec_blocks_for_tokens(block_size: int, token_count: int) -> int:
    _check_count_domain(block_size, token_count)
    return spec.blocks_for_tokens(block_size, token_count)


def impl_blocks_for_tokens(block_size: int, token_count: int) -> int:
    _check_count_domain(block_size, token_count)
    # The blocks the impl gives a new table of ``token_count`` tokens, in a pool just large
    # enough for a table of one token per block.
    manager = KVCacheManager(max(token_count, 1), block_size)
    return len(manager.allocate("a", token_count).block_ids[0])


def _spec_state_before_the_token(
    block_size: int, position: int, reused_blocks: int
) -> spec.AllocatorState:
    # The pool holds just the blocks the request needs once the token is in. A filler
    # request first takes up to ``reused_blocks`` of them and gives them back (last first),
    # so the request's blocks are not 0, 1, 2, ... and a slot is not just its position.
    total_blocks = position // block_size + 1
    state = spec.init(total_blocks, block_size)
    state = spec.allocate(state, "filler", min(reused_blocks, total_blocks) * block_size)
    state = spec.release(state, "filler")
    return spec.allocate(state, "r", position)


def _impl_pool_before_the_token(
    block_size: int, position: int, reused_blocks: int
) -> KVBlockManager:
    total_blocks = position // block_size + 1
    pool = KVBlockManager(total_blocks, block_size)
    pool.allocate("filler", min(reused_blocks, total_blocks) * block_size)
    pool.release("filler")
    pool.allocate("r", position)
    return pool


def spec_slot_of_next_token(block_size: int, position: int, reused_blocks: int) -> int:
    _check_domain(block_size, position, reused_blocks)
    state = _spec_state_before_the_token(block_size, position, reused_blocks)
    grown = spec.append(state, "r", 1)
    return spec.slot_index(block_size, spec.snapshot_request(grown, "r").block_ids, position)


def impl_slot_of_next_token(block_size: int, position: int, reused_blocks: int) -> int:
    _check_domain(block_size, position, reused_blocks)
    return _impl_pool_before_the_token(block_size, position, reused_blocks).append_slot("r")


def spec_next_token_opens_a_block(block_size: int, position: int) -> bool:
    _check_domain(block_size, position, 0)
    needed_before = spec.blocks_for_tokens(block_size, position)
    return spec.blocks_for_tokens(block_size, position + 1) > needed_before


def impl_next_token_opens_a_block(block_size: int, position: int) -> bool:
    _check_domain(block_size, position, 0)
    pool = _impl_pool_before_the_token(block_size, position, 0)
    free_before = pool.free_blocks
    pool.append_slot("r")
    return pool.free_blocks < free_before
