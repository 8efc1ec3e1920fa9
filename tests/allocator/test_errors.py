"""BlockAllocationError: the numbers in its message and on its attributes, and pickling."""

import pickle

from spec import BlockAllocationError


def test_the_error_carries_the_request_and_the_blocks_needed_and_free() -> None:
    error = BlockAllocationError("b", 2, 1)
    assert str(error) == "request 'b' needs 2 more block(s) but only 1 are free"
    assert (error.request_id, error.blocks_needed, error.blocks_free) == ("b", 2, 1)
    assert isinstance(error, RuntimeError)


def test_the_error_survives_a_pickle_round_trip_with_its_numbers() -> None:
    # pytest-xdist and multiprocessing send errors across processes by pickling them.
    copy = pickle.loads(pickle.dumps(BlockAllocationError("b", 2, 1)))
    assert type(copy) is BlockAllocationError
    assert str(copy) == "request 'b' needs 2 more block(s) but only 1 are free"
    assert (copy.request_id, copy.blocks_needed, copy.blocks_free) == ("b", 2, 1)
