"""Bad input tried on purpose: every refusal is a typed error with one clear message, spec
and impl raise the same one, and a refused call changes nothing.

Each case is a call found to slip through before (issue "Bad input, tried on purpose"). The
lockstep state machine draws such arguments at random too; these pin the literal cases.
"""

from collections.abc import Callable

import pytest

import spec
from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS
from tests.support.planted_bugs import TakesAnyIterableAsTokenIds

Manager = KVCacheManager | SpecBackedManager
Call = Callable[[Manager], object]


def _a_pool_with_a_prompt_and_a_counted_request(make: type[Manager]) -> Manager:
    pool = make(4, 4)
    pool.allocate("p", [1, 2, 3])
    pool.allocate("c", 2)
    return pool


def _state(pool: Manager) -> object:
    return (pool.to_spec(), pool.usage())


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: m.allocate("b", (1, 2, 3, [4])),
            TypeError,
            "token id 3 must be an int, got list [4]",
        ),
        (
            lambda m: m.append("p", (4, [5], 6, 7, 8)),
            TypeError,
            "token id 1 must be an int, got list [5]",
        ),
        (lambda m: m.append("p", [4.0]), TypeError, "token id 0 must be an int"),
        (lambda m: m.append("p", [True]), TypeError, "got bool True"),
        (lambda m: m.append("p", [-1]), ValueError, "token id 0 must be in [0, "),
        (lambda m: m.append("p", [2**32]), ValueError, "got 4294967296"),
        (lambda m: m.allocate("b", 2.0), TypeError, "token_count must be an int, got float 2.0"),
        (lambda m: m.allocate("b", True), TypeError, "token_count must be an int, got bool True"),
        (lambda m: m.append("c", False), TypeError, "got bool False"),
        (lambda m: m.append("c", 1.5), TypeError, "got float 1.5"),
        (lambda m: m.append("c", "3"), TypeError, "token_count must be an int, got str '3'"),
        (lambda m: m.allocate(float("nan"), 1), TypeError, "request_id must be a str, got float"),
        (lambda m: m.allocate(None, [1]), TypeError, "request_id must be a str"),
        (lambda m: m.allocate("b", 1, "salt"), ValueError, "a cache salt needs token ids"),
        (lambda m: m.fork("p", 7), TypeError, "request_id must be a str, got int 7"),
        (lambda m: m.release(7), TypeError, "request_id must be a str, got int 7"),
        (lambda m: m.preempt(None), TypeError, "request_id must be a str, got NoneType None"),
        (lambda m: m.truncate(b"p", 1), TypeError, "request_id must be a str, got bytes b'p'"),
        (lambda m: m.swap_out(7), TypeError, "request_id must be a str, got int 7"),
        (lambda m: m.swap_in(7), TypeError, "request_id must be a str, got int 7"),
        (
            lambda m: m.cached_prefix_tokens(None),
            TypeError,
            "token_ids must be a sequence of token ids, got NoneType None",
        ),
        (lambda m: m.cached_prefix_tokens({1, 2}), TypeError, "got set {1, 2}"),
        (lambda m: m.append("p", 2), ValueError, "cannot append a count (2) to request 'p'"),
        (lambda m: m.append("c", [1, 2]), ValueError, "cannot append 2 token ids to request 'c'"),
    ],
)
@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_a_malformed_argument_is_refused_by_type_and_changes_nothing(
    make: type[Manager], call: Call, error: type[Exception], message: str
) -> None:
    pool = _a_pool_with_a_prompt_and_a_counted_request(make)
    before = _state(pool)
    with pytest.raises(error) as refused:
        call(pool)
    assert message in str(refused.value)
    assert _state(pool) == before
    # Still usable: a valid append lands where it would have.
    assert pool.append("p", [4]).slots == ((3,),)


def test_spec_and_impl_refuse_a_numpy_token_id_alike() -> None:
    numpy = pytest.importorskip("numpy")
    messages = []
    for make in (SpecBackedManager, KVCacheManager):
        pool = _a_pool_with_a_prompt_and_a_counted_request(make)
        before = _state(pool)
        with pytest.raises(TypeError) as refused:
            pool.append("p", [numpy.array(4)])
        assert _state(pool) == before
        messages.append(str(refused.value))
    assert messages[0] == messages[1] == "token id 0 must be an int, got ndarray array(4)"


@pytest.mark.parametrize(
    ("total_blocks", "block_size", "error", "message"),
    [
        (10**30, 16, ValueError, f"total_blocks must be at most {MAX_TOTAL_BLOCKS:,}, got 1,000"),
        (16, 10**6, ValueError, f"block_size must be at most {MAX_BLOCK_SIZE:,}, got 1,000,000"),
        (16, 2.0, TypeError, "block_size must be an int, got float 2.0"),
        (16, 2.5, TypeError, "block_size must be an int, got float 2.5"),
        (16, float("nan"), TypeError, "block_size must be an int, got float nan"),
        (16, float("inf"), TypeError, "block_size must be an int, got float inf"),
        (4.0, 16, TypeError, "total_blocks must be an int, got float 4.0"),
        (True, 16, TypeError, "total_blocks must be an int, got bool True"),
        (0, 16, ValueError, "total_blocks must be at least 1, got 0"),
    ],
)
@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_a_pool_that_cannot_be_served_is_refused_at_once(
    make: type[Manager],
    total_blocks: object,
    block_size: object,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as refused:
        make(total_blocks, block_size)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_a_host_prefix_cache_without_a_host_tier_is_refused_at_once(make: type[Manager]) -> None:
    with pytest.raises(ValueError) as refused:
        make(4, 4, host_blocks=0, host_prefix_cache=True)
    assert str(refused.value) == (
        "host_prefix_cache needs a host tier to demote freed prefixes to: host_blocks is 0"
    )


@pytest.mark.parametrize(
    "tokens", [None, 1.5, "abc", (1, "x"), {1, 2}], ids=["none", "float", "str", "ids", "set"]
)
@pytest.mark.parametrize("make", [SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def test_a_held_request_id_is_refused_before_whatever_its_tokens_are(
    make: type[Manager], tokens: object
) -> None:
    # Issue 33: one order, ``spec.errors.check_allocate``, for both.
    pool = _a_pool_with_a_prompt_and_a_counted_request(make)
    before = _state(pool)
    with pytest.raises(ValueError, match="request already has allocated blocks: c"):
        pool.allocate("c", tokens)  # type: ignore[arg-type]
    assert _state(pool) == before


def test_a_request_id_that_is_not_itself_cannot_break_the_invariants() -> None:
    pool = KVCacheManager(4, 4)
    with pytest.raises(TypeError):
        pool.allocate(float("nan"), 1)  # type: ignore[arg-type]
    pool.check_invariants()
    assert pool.usage().request_count == 0


def test_the_extras_are_keyword_only_so_a_tuple_of_windows_is_not_taken_for_a_hash() -> None:
    make: Callable[..., KVCacheManager] = KVCacheManager  # the call mypy would refuse
    with pytest.raises(TypeError, match="positional argument"):
        make(8, 4, (None, 4))
    kinds = (spec.FullAttention(), spec.SlidingWindow(4))
    assert KVCacheManager(8, 4, group_windows=(None, 4)).group_windows == kinds


def test_a_block_hash_that_is_not_callable_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"^block_hash must be callable, got tuple \(None, 4\)$"):
        KVCacheManager(8, 4, block_hash=(None, 4))  # type: ignore[arg-type]


class _HashError(Exception):
    pass


def _hash_that_raises_on(poison: int) -> Callable[[int, tuple[int, ...]], int]:
    def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
        if poison in token_ids:
            raise _HashError(f"cannot hash {token_ids}")
        return hash((parent_hash, token_ids))

    return block_hash


def _impl_state(pool: KVCacheManager) -> object:
    return (pool.to_spec(), pool.usage())


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate("b", [1, 2, 3, 4, 9, 9, 9, 9, 5]),
        lambda m: m.allocate("b", [9, 2, 3, 4, 5]),
        lambda m: m.append("p", [4, 5, 9, 6, 7, 8]),
        lambda m: m.append("p", [9]),
    ],
    ids=["prompt-second-block", "prompt-first-block", "append-ids", "append-ids-one"],
)
def test_a_block_hash_that_raises_leaves_the_manager_unchanged(call: Call) -> None:
    pool = KVCacheManager(8, 4, block_hash=_hash_that_raises_on(9))
    pool.allocate("p", [1, 2, 3])
    before = _impl_state(pool)
    with pytest.raises(_HashError):
        call(pool)
    assert _impl_state(pool) == before
    pool.check_invariants()
    assert pool.append("p", [4]).slots == ((3,),)  # still usable, where it would have been


def _odd_token_differences(target_class: type[KVCacheManager]) -> list[str]:
    """Each value lockstep's ``ODD_VALUES`` draws, given to ``allocate`` on a fresh pool:
    where the target's outcome (its error, or admitting) differs from the spec's."""
    from tests.support.lockstep import ODD_VALUES  # noqa: PLC0415

    differences = []
    for tokens in ODD_VALUES:
        outcomes = []
        for make in (SpecBackedManager, target_class):
            try:
                make(8, 2).allocate("r0", tokens)  # type: ignore[arg-type]
                outcomes.append("admitted")
            except Exception as error:  # the error itself is compared
                outcomes.append(f"{type(error).__name__}: {error}")
        if outcomes[0] != outcomes[1]:
            differences.append(f"{tokens!r}: spec {outcomes[0]}, target {outcomes[1]}")
    return differences


def test_allocate_treats_every_odd_token_collection_as_the_spec_does() -> None:
    assert _odd_token_differences(KVCacheManager) == []


def test_a_target_taking_any_iterable_as_token_ids_differs_from_the_spec() -> None:
    assert _odd_token_differences(TakesAnyIterableAsTokenIds)
