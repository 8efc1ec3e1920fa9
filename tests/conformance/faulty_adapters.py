"""Adapters and factories with a fault of their own, not of the allocator they wrap: each
the template's adapter (``adapter_template``) with one thing a user gets wrong, for the
kit to refuse before its first step (``tests/conformance/test_validate.py``). Named as
``tests.conformance.faulty_adapters:NAME`` from the command line."""

from collections.abc import Mapping
from types import MappingProxyType

from harness.conformance import Observation
from spec import RecurrentState
from tests.conformance.adapter_template import TinyPrefixPoolAdapter, make


class NeedsNothing(TinyPrefixPoolAdapter):
    """The template's adapter under a name of its own: a fresh one per call, no fault."""


def raises() -> TinyPrefixPoolAdapter:
    raise RuntimeError("the pool's config file is missing")


def returns_none() -> None:
    """A factory that forgets its ``return``."""


def returns_the_class() -> type[TinyPrefixPoolAdapter]:
    return TinyPrefixPoolAdapter


def needs_an_argument(num_blocks: int) -> TinyPrefixPoolAdapter:
    return TinyPrefixPoolAdapter()


_ONLY = TinyPrefixPoolAdapter()


def returns_the_same_instance() -> TinyPrefixPoolAdapter:
    """One allocator for every test case: the state of one case carries over to the next."""
    return _ONLY


class _WithoutObserve:
    """An adapter that has everything but ``observe``."""

    name = "WithoutObserve"
    exact = False
    block_size = 4
    group_windows: tuple[int | None, ...] = (None,)
    pool_block_ids = range(12)
    supports = frozenset({"allocate_prompt", "append_token_ids", "release"})
    differences: Mapping[str, str] = MappingProxyType({})


def without_observe() -> _WithoutObserve:
    return _WithoutObserve()


class _ObserveRaises(TinyPrefixPoolAdapter):
    def observe(self) -> Observation:
        raise AttributeError("'TinyPrefixPool' object has no attribute 'blocks'")


def observe_raises() -> _ObserveRaises:
    return _ObserveRaises()


class _ObserveIsNotAMethod(TinyPrefixPoolAdapter):
    observe = None  # type: ignore[assignment]


def observe_is_not_a_method() -> _ObserveIsNotAMethod:
    return _ObserveIsNotAMethod()


class _ObserveReturnsNone(TinyPrefixPoolAdapter):
    def observe(self) -> Observation:
        return None  # type: ignore[return-value]


def observe_returns_none() -> _ObserveReturnsNone:
    return _ObserveReturnsNone()


class _ObserveRaisesLater(TinyPrefixPoolAdapter):
    """``observe`` works on a fresh adapter and raises from its 7th call on."""

    observations = 0

    def observe(self) -> Observation:
        self.observations += 1
        if self.observations >= 7:
            raise KeyError("r3")
        return super().observe()


def observe_raises_later() -> _ObserveRaisesLater:
    return _ObserveRaisesLater()


class _TakeEventsRaises(TinyPrefixPoolAdapter):
    supports = frozenset({*TinyPrefixPoolAdapter.supports, "kv_events"})

    def take_events(self) -> list[object]:
        raise RuntimeError("the event queue is closed")


def take_events_raises() -> _TakeEventsRaises:
    return _TakeEventsRaises()


_MADE = [0]


def fails_later() -> TinyPrefixPoolAdapter:
    """A factory that runs out of something at its 5th call, a few test cases in."""
    _MADE[0] += 1
    if _MADE[0] >= 5:
        raise OSError("too many open files")
    return TinyPrefixPoolAdapter()


def _declaring(**attributes: object) -> type[TinyPrefixPoolAdapter]:
    """The template's adapter with ``attributes`` declared in place of its own."""
    return type("TinyPrefixPoolAdapter", (TinyPrefixPoolAdapter,), attributes)


block_size_0 = _declaring(block_size=0)
block_size_str = _declaring(block_size="4")
block_size_negative = _declaring(block_size=-4)
block_size_float = _declaring(block_size=4.0)
block_size_bool = _declaring(block_size=True)
group_windows_empty = _declaring(group_windows=())
group_windows_an_int = _declaring(group_windows=6)
group_windows_zero_window = _declaring(group_windows=(None, 0))
supports_empty = _declaring(supports=frozenset())
supports_unknown = _declaring(supports=frozenset({"allocate_prompt", "relase"}))
supports_a_str = _declaring(supports="allocate_prompt")
supports_missing_method = _declaring(
    supports=frozenset({"allocate_prompt", "append_token_ids", "release", "fork"})
)
group_windows_off_grid = _declaring(group_windows=(None, RecurrentState(6)))
pool_empty = _declaring(pool_block_ids=())
pool_of_strs = _declaring(pool_block_ids=("a", "b"))
pool_repeats = _declaring(pool_block_ids=(0, 1, 1, 2))
name_empty = _declaring(name="")
differences_a_list = _declaring(differences=["conservation"])
differences_unknown = _declaring(differences={"conservaton": "our pool leaks by design"})
exact_a_str = _declaring(exact="yes")
kv_events_without_take_events = _declaring(
    supports=frozenset({"allocate_prompt", "append_token_ids", "release", "kv_events"})
)


class _ObserveShowsTwoGroups(TinyPrefixPoolAdapter):
    def observe(self) -> Observation:
        shown = super().observe()
        return Observation(tables=shown.tables * 2, free_block_ids=shown.free_block_ids)


def observe_shows_two_groups() -> _ObserveShowsTwoGroups:
    return _ObserveShowsTwoGroups()


class _HugePool(TinyPrefixPoolAdapter):
    """A pool of 10**8 blocks (a range: declaring it is free, the kit must not walk it)."""

    pool_block_ids = range(10**8)


def huge_pool() -> _HugePool:
    return _HugePool()


__all__ = ["NeedsNothing", "make"]
