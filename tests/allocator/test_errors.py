"""BlockAllocationError as the article builds it and as pagedkv raises it, and pickling."""

import pickle

from spec import BlockAllocationError


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
