"""The spec's arithmetic helpers against the impl's, compared by Hypothesis.

The pairs live in tests/support/helper_pairs.py; scripts/crosshair_check.sh hands the same pairs to
CrossHair, which explores them symbolically until every path is exhausted.
"""

from hypothesis import given
from hypothesis import strategies as st

from tests.support.helper_pairs import (
    MAX_BLOCK_SIZE,
    MAX_POSITION,
    MAX_REUSED_BLOCKS,
    impl_blocks_for_tokens,
    impl_next_token_opens_a_block,
    impl_slot_of_next_token,
    spec_blocks_for_tokens,
    spec_next_token_opens_a_block,
    spec_slot_of_next_token,
)

BLOCK_SIZES = st.integers(-1, MAX_BLOCK_SIZE + 1)
POSITIONS = st.integers(-1, MAX_POSITION + 1)
REUSED = st.integers(-1, MAX_REUSED_BLOCKS + 1)


@given(block_size=st.integers(-2, 4100), token_count=st.integers(-2, 4100))
def test_spec_and_impl_agree_on_the_blocks_a_token_count_needs(
    block_size: int, token_count: int
) -> None:
    try:
        expected: int | str = spec_blocks_for_tokens(block_size, token_count)
    except ValueError as error:
        expected = str(error)
    try:
        actual: int | str = impl_blocks_for_tokens(block_size, token_count)
    except ValueError as error:
        actual = str(error)
    assert actual == expected


@given(block_size=BLOCK_SIZES, position=POSITIONS, reused_blocks=REUSED)
def test_spec_and_impl_put_the_next_token_in_the_same_slot(
    block_size: int, position: int, reused_blocks: int
) -> None:
    try:
        expected: int | str = spec_slot_of_next_token(block_size, position, reused_blocks)
    except ValueError as error:
        expected = str(error)
    try:
        actual: int | str = impl_slot_of_next_token(block_size, position, reused_blocks)
    except ValueError as error:
        actual = str(error)
    assert actual == expected


@given(block_size=BLOCK_SIZES, position=POSITIONS)
def test_spec_and_impl_agree_on_which_tokens_open_a_block(block_size: int, position: int) -> None:
    try:
        expected: bool | str = spec_next_token_opens_a_block(block_size, position)
    except ValueError as error:
        expected = str(error)
    try:
        actual: bool | str = impl_next_token_opens_a_block(block_size, position)
    except ValueError as error:
        actual = str(error)
    assert actual == expected


def test_a_token_opens_a_block_exactly_at_multiples_of_the_block_size() -> None:
    opening = [p for p in range(MAX_POSITION + 1) if spec_next_token_opens_a_block(3, p)]
    assert opening == [0, 3, 6, 9, 12, 15]


def test_reused_blocks_make_slots_differ_from_positions() -> None:
    # Blocks of 2 tokens, a filler of up to two blocks: the free queue ends ..., 1, 0, so the
    # block that holds the next token is always block 0, the filler's first, given back last.
    slots = [spec_slot_of_next_token(2, position, 2) for position in range(6)]
    assert slots == [0, 1, 0, 1, 0, 1]
