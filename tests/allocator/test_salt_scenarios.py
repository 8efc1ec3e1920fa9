"""Cache salts (tenants that cannot see each other's prefixes), with literal block ids, on
spec and impl alike."""

from collections.abc import Callable

import pytest

from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import RequestBlockTable
from tests.support.reading import admitted, cached_free_ids, free_ids

Manager = KVCacheManager | SpecBackedManager
Factory = Callable[[int, int], KVCacheManager]
TEN = list(range(1, 11))  # a 10-token prompt: two full blocks of 4 and half a third


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    factory: Factory = request.param
    return factory


def test_the_same_prompt_under_two_salts_shares_nothing(make: Factory) -> None:
    pool = make(12, 4)
    assert pool.allocate("a", TEN).table().block_ids == (0, 1, 2)
    # Tenant t1 misses the unsalted blocks 0 and 1 and caches its own.
    assert admitted(pool.allocate("b", TEN, "t1")) == (RequestBlockTable("b", (3, 4, 5), 10), 0)
    assert admitted(pool.allocate("c", TEN, "t1")) == (RequestBlockTable("c", (3, 4, 6), 10), 8)
    assert admitted(pool.allocate("d", TEN)) == (RequestBlockTable("d", (0, 1, 7), 10), 8)
    assert pool.usage().cached_blocks == 4


def test_the_empty_salt_is_a_namespace_apart_from_no_salt(make: Factory) -> None:
    pool = make(8, 4)
    pool.allocate("a", TEN)
    assert pool.cached_prefix_tokens(TEN) == 8
    assert pool.cached_prefix_tokens(TEN, "") == 0
    assert pool.allocate("b", TEN, "").cached_tokens == 0


def test_a_revived_cached_free_block_keeps_its_salt(make: Factory) -> None:
    pool = make(8, 4)
    pool.allocate("a", TEN, "t1")
    pool.release("a")
    assert cached_free_ids(pool) == (1, 0)
    assert pool.allocate("b", TEN, "t1").table().block_ids == (0, 1, 3)
    pool.release("b")
    # Still tenant t1's: an unsalted prompt misses and evicts nothing it could share.
    assert admitted(pool.allocate("c", TEN)) == (RequestBlockTable("c", (4, 5, 6), 10), 0)
    assert pool.cached_prefix_tokens(TEN, "t1") == 8


def test_a_fork_caches_what_it_fills_under_its_parents_salt(make: Factory) -> None:
    pool = make(8, 4)
    pool.allocate("a", [1, 2, 3], "t1")  # block 0, partly filled
    pool.fork("a", "f")
    pool.append("f", [4])  # copies block 0 into block 1 and fills it
    assert pool.take_transfers().copies == ((0, 1),)
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 5], "t1") == 4
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 5]) == 0
    assert pool.allocate("x", [1, 2, 3, 4, 5], "t1").table().block_ids == (1, 2)


def test_a_salt_of_the_wrong_type_is_refused_and_changes_nothing(make: Factory) -> None:
    pool = make(4, 4)
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got int 7"):
        pool.allocate("a", TEN, 7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got bytes"):
        pool.cached_prefix_tokens(TEN, b"t1")  # type: ignore[arg-type]
    assert free_ids(pool) == (0, 1, 2, 3)
    assert not pool.to_spec().tables


def test_a_salt_with_a_lone_surrogate_is_a_namespace_of_its_own(make: Factory) -> None:
    # A JSON request's "\ud800" decodes to a lone surrogate: a str, hashed like any other.
    pool = make(12, 4)
    assert pool.allocate("a", TEN, "\ud800").cached_tokens == 0
    assert pool.cached_prefix_tokens(TEN, "\ud800") == 8
    assert pool.cached_prefix_tokens(TEN, "\udc00") == 0
    assert pool.cached_prefix_tokens(TEN) == 0
    assert pool.allocate("b", TEN, "\ud800").cached_tokens == 8
