"""spec.rules, the paged-KV arithmetic everything else imports, and the rule the kinds share
(``spec.kinds.copies_hit``), on literal values."""

import pytest

from spec import (
    blocks_for_tokens,
    first_window_token,
    next_skip_token_count,
    skipped_blocks_at,
    slot_index,
)
from spec.kinds import FullAttention, RecurrentState, SlidingWindow, copies_hit
from spec.rules import blocks_for_request


def test_blocks_for_tokens_rounds_up_and_refuses_a_block_size_below_1() -> None:
    assert [blocks_for_tokens(4, n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert blocks_for_tokens(1, 3) == 3
    with pytest.raises(ValueError, match=r"^block_size must be at least 1, got 0$"):
        blocks_for_tokens(0, 3)
    with pytest.raises(ValueError, match="token_count"):
        blocks_for_tokens(4, -1)
    assert blocks_for_request(4, 5, 3) == 6


def test_a_tokens_slot_is_its_blocks_row_plus_its_offset() -> None:
    # Table [7, 2]: tokens 0..3 in block 7 (rows 28..31), 4..5 in block 2 (rows 8..9).
    assert [slot_index(4, [7, 2], p) for p in range(6)] == [28, 29, 30, 31, 8, 9]
    assert slot_index(1, [5, 3], 1) == 3


def test_a_windowed_tables_first_block_holds_block_index_skipped_blocks() -> None:
    # Two blocks skipped: [7, 2] holds block indexes 2 and 3, tokens 8..15.
    assert [slot_index(4, [7, 2], p, 2) for p in (8, 11, 12, 15)] == [28, 31, 8, 11]
    with pytest.raises(ValueError, match=r"^position 7 lies in the first 2 blocks, which"):
        slot_index(4, [7, 2], 7, 2)
    with pytest.raises(ValueError, match=r"^position must be >= 0, got -1$"):
        slot_index(4, [7, 2], -1)
    assert slot_index(4, [7, 2], 0, 0) == 28


def test_a_window_of_w_tokens_reads_from_position_l_minus_w_plus_1() -> None:
    assert [first_window_token(n, 4) for n in (0, 3, 4, 5, 10)] == [0, 0, 1, 2, 7]
    assert first_window_token(10, None) == 0
    assert first_window_token(10, 1) == 10
    # Block size 2, window 4: at length 10 tokens 7.. are read, so blocks 0..2 are skipped.
    assert skipped_blocks_at(2, 10, 4) == 3
    assert skipped_blocks_at(2, 10, None) == 0
    # The next skip (a fourth block) comes at length 4 * 2 + 4 - 1 = 11.
    assert next_skip_token_count(2, 3, 4) == 11
    assert skipped_blocks_at(2, 11, 4) == 4
    assert skipped_blocks_at(2, 10, 4) == 3
    assert next_skip_token_count(2, 3, None) is None


def test_an_admission_copies_its_hit_only_where_the_kind_copies_a_cached_block_it_writes() -> None:
    # A state group rewrites its checkpoint and copies a cached block first: always.
    assert copies_hit(RecurrentState(4), 4, 8)
    # Attention writes into the hit's last block only off a block boundary, and copies a
    # block only when it is shared: never, on a boundary or off it.
    for kind in (FullAttention(), SlidingWindow(8)):
        assert not copies_hit(kind, 4, 8)
        assert not copies_hit(kind, 4, 6)
