"""BlockAllocationError as the article builds it and as pagedkv raises it, and pickling."""

import pickle

import pytest

from spec import BlockAllocationError, FullAttention, RecurrentState, SlidingWindow, group_kinds
from spec.errors import (
    MAX_BLOCK_SIZE,
    MAX_TOKEN_ID,
    MAX_TOTAL_BLOCKS,
    check_host_tier,
    check_pool_shape,
    check_token_ids,
    check_truncate,
)
from spec.kinds import kind_names


def test_the_error_constructs_from_a_message_as_the_articles_does() -> None:
    error = BlockAllocationError("not enough free KV blocks: needed=2 free=1")
    assert isinstance(error, RuntimeError)
    assert str(error) == "not enough free KV blocks: needed=2 free=1"
    assert (error.request_id, error.needed_blocks, error.free_blocks) == (None, None, None)


def test_the_error_pagedkv_raises_carries_the_request_and_the_needed_and_free_blocks() -> None:
    error = BlockAllocationError.out_of_blocks("b", 2, 1)
    assert str(error) == "not enough free KV blocks: needed=2 free=1 (request 'b')"
    assert (error.request_id, error.needed_blocks, error.free_blocks) == ("b", 2, 1)


def test_the_error_survives_a_pickle_round_trip_with_its_numbers() -> None:
    # pytest-xdist and multiprocessing send errors across processes by pickling them.
    copy = pickle.loads(pickle.dumps(BlockAllocationError.out_of_blocks("b", 2, 1)))
    assert type(copy) is BlockAllocationError
    assert str(copy) == "not enough free KV blocks: needed=2 free=1 (request 'b')"
    assert (copy.request_id, copy.needed_blocks, copy.free_blocks) == ("b", 2, 1)


def test_each_bound_is_inclusive_and_the_value_past_it_is_refused() -> None:
    check_pool_shape(MAX_TOTAL_BLOCKS, MAX_BLOCK_SIZE)
    check_pool_shape(1, 1)
    too_many = r"^total_blocks must be at most 16,777,216, got 16,777,217$"
    with pytest.raises(ValueError, match=too_many):
        check_pool_shape(MAX_TOTAL_BLOCKS + 1, 1)
    with pytest.raises(ValueError, match=r"^block_size must be at most 65,536, got 65,537$"):
        check_pool_shape(1, MAX_BLOCK_SIZE + 1)
    check_host_tier(MAX_TOTAL_BLOCKS, False)
    with pytest.raises(ValueError, match=r"^host_blocks must be in \[0, "):
        check_host_tier(MAX_TOTAL_BLOCKS + 1, False)
    check_token_ids([0, MAX_TOKEN_ID])
    with pytest.raises(ValueError, match="token"):
        check_token_ids([MAX_TOKEN_ID + 1])
    assert group_kinds([1, None], 4, 0) == (SlidingWindow(1), FullAttention())
    with pytest.raises(ValueError, match="window"):
        group_kinds([0], 4, 0)


def test_a_window_kind_of_another_type_is_refused_with_its_group_and_type() -> None:
    with pytest.raises(TypeError, match=r"^window of group 1 must be an int, got str '8'$"):
        group_kinds([None, SlidingWindow("8")], 4, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^window of group 0 must be an int, got bool True$"):
        group_kinds([SlidingWindow(True)], 4, 0)


def test_the_kinds_are_named_in_messages_by_their_plain_names() -> None:
    kinds = (FullAttention(), SlidingWindow(8), RecurrentState(4))
    assert kind_names(kinds) == "[full attention, window 8, recurrent state checkpointed every 4]"


def test_a_host_tier_argument_of_another_type_is_refused_with_its_type() -> None:
    with pytest.raises(TypeError) as refused:
        check_host_tier(4, 1)
    assert str(refused.value) == "host_prefix_cache must be a bool, got int 1"
    with pytest.raises(TypeError) as refused:
        check_host_tier("4", False)
    assert str(refused.value) == "host_blocks must be an int, got str '4'"


def test_truncating_to_the_tokens_held_is_allowed_and_one_more_is_refused() -> None:
    def check(token_count: int) -> None:
        check_truncate(
            "a",
            token_count,
            5,
            block_size=2,
            group_windows=(FullAttention(),),
            skipped_blocks=(0,),
        )

    check(5)
    with pytest.raises(ValueError, match=r"^cannot truncate request 'a' to 6 tokens: it holds 5$"):
        check(6)
