"""FrozenMap: a read-only mapping that hashes by content, so states can sit in a set."""

import pytest

from spec import FrozenMap


def test_equal_maps_are_equal_and_hash_equal_whatever_their_insertion_order() -> None:
    forward = FrozenMap({"a": 1, "b": 2})
    backward = FrozenMap({"b": 2, "a": 1})
    assert forward == backward
    assert hash(forward) == hash(backward)


def test_different_maps_mostly_hash_apart() -> None:
    # Not a correctness rule but the bounded checker's speed: it keeps millions of states
    # in a set, and a hash that lumped maps together would make every lookup a scan.
    hashes = {hash(FrozenMap({f"r{i}": i})) for i in range(200)}
    assert len(hashes) > 190


def test_a_frozen_map_is_never_equal_to_a_plain_dict() -> None:
    assert (FrozenMap({"a": 1}) == {"a": 1}) is False
    assert FrozenMap({"a": 1}) != {"a": 1}


def test_set_and_delete_return_copies_and_leave_the_original_alone() -> None:
    original = FrozenMap({"a": 1})
    assert original.set("b", 2) == FrozenMap({"a": 1, "b": 2})
    assert original.set("a", 3) == FrozenMap({"a": 3})
    assert original.delete("a") == FrozenMap()
    assert original == FrozenMap({"a": 1})
    assert len(original) == 1
    assert list(original) == ["a"]


def test_deleting_an_absent_key_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        FrozenMap({"a": 1}).delete("b")


def test_a_frozen_map_shows_its_items() -> None:
    assert repr(FrozenMap({"a": 1})) == "FrozenMap({'a': 1})"
