"""An ``event_sink`` that raises: the call completes as the spec says, every event of the
call is offered to the sink, and the sink's first error reaches the caller afterwards
(``spec.events``, "Delivery"). A property over random operation sequences, with a sink
that raises on a drawn kind of event at a drawn period, and the issue's reproduction."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import spec
from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager, as_impl
from spec import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from spec.api import OPERATIONS
from tests.support.lockstep import ARGUMENTS, GROUP_WINDOWS, REFUSALS

EVENT_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)


class SinkError(Exception):
    """What the test's sink raises: no refusal of the allocator's is of this type."""


class RaisingSink:
    """Records every event offered; raises ``SinkError`` on every ``period``-th event of the
    kinds in ``kinds`` (counted over the whole run, so every position in a call comes up)."""

    def __init__(self, kinds: frozenset[type], period: int, phase: int) -> None:
        self.kinds = kinds
        self.period = period
        self.seen = phase
        self.offered: list[KVCacheEvent] = []
        self.raised: list[SinkError] = []

    def __call__(self, event: KVCacheEvent) -> None:
        self.offered.append(event)
        if type(event) in self.kinds:
            self.seen += 1
            if self.seen % self.period == 0:
                self.raised.append(SinkError(event))
                raise self.raised[-1]


SINKS = st.builds(
    RaisingSink,
    st.frozensets(st.sampled_from(EVENT_KINDS), min_size=1),
    st.integers(1, 3),
    st.integers(0, 2),
)
# Pools: blocks, block size, KV cache groups, host blocks and host prefix caching.
POOLS = st.tuples(
    st.integers(1, 10),
    st.integers(1, 4),
    st.one_of(st.just((None,)), GROUP_WINDOWS),
    st.sampled_from([(0, False), (3, False), (6, True)]),
)


def _check_step(target: KVCacheManager, model: spec.AllocatorState) -> None:
    """The target is whole and in the spec's state ``model`` (events taken)."""
    target.check_invariants()
    assert target.to_spec() == model
    assert target.usage() == spec.usage(model)


@given(data=st.data(), sink=SINKS, pool=POOLS)
def test_a_raising_sink_leaves_every_call_done_as_the_spec_does_and_raises_after_it(
    data: st.DataObject,
    sink: RaisingSink,
    pool: tuple[int, int, tuple[int | None, ...], tuple[int, bool]],
) -> None:
    total_blocks, block_size, group_windows, (host_blocks, host_prefix_cache) = pool
    model = spec.init(total_blocks, block_size, group_windows, host_blocks, host_prefix_cache)
    target = KVCacheManager(
        total_blocks,
        block_size,
        group_windows=group_windows,
        event_sink=sink,
        host_blocks=host_blocks,
        host_prefix_cache=host_prefix_cache,
    )
    for _ in range(data.draw(st.integers(1, 40))):
        name = data.draw(st.sampled_from(sorted(OPERATIONS)))
        row = OPERATIONS[name]
        args = data.draw(st.tuples(*(ARGUMENTS[argument] for argument in row.arguments)))
        sink.offered.clear()
        sink.raised.clear()
        try:
            after, expected = row.transition(model, *args)
        except REFUSALS as refusal:
            with pytest.raises(type(refusal)) as refused:
                getattr(target, name)(*args)
            assert str(refused.value) == str(refusal)
            assert sink.offered == [], f"{name}{args}: refused, but events were offered"
            _check_step(target, model)
            continue
        model = spec.take_events(after)
        try:
            actual = getattr(target, name)(*args)
        except SinkError as error:
            assert sink.raised, f"{name}{args}: SinkError, but the sink raised none"
            assert error is sink.raised[0], f"{name}{args}: not the sink's first error"
        else:
            assert not sink.raised, f"{name}{args}: the sink raised {sink.raised}, the call not"
            assert actual == as_impl(expected)
        assert sink.offered == list(after.events), f"{name}{args}: events offered"
        _check_step(target, model)
    # Nothing leaks, whatever the sink raised on the way (a release emits no event).
    for request_id in sorted(model.host.swapped) + sorted(model.tables):
        model = spec.release(model, request_id)
        target.release(request_id)
    model = spec.take_transfers(model)
    target.take_transfers()
    _check_step(target, model)
    assert target.usage().free_blocks == total_blocks


@pytest.mark.parametrize("manager", [KVCacheManager, SpecBackedManager], ids=["impl", "spec"])
def test_a_sink_raising_in_an_eviction_leaves_the_allocation_done_and_no_block_leaked(
    manager: type[KVCacheManager] | type[SpecBackedManager],
) -> None:
    # The reproduction: the allocation evicts the cached free block of "a".
    on: list[int] = []

    def sink(event: KVCacheEvent) -> None:
        if on:
            raise SinkError(event)

    pool = manager(2, 2, event_sink=sink)
    pool.allocate("a", [1, 2, 3])
    pool.release("a")
    on.append(1)
    with pytest.raises(SinkError, match="BlockRemoved"):
        pool.allocate("b", 4)
    assert pool.tables("b")[0].block_ids == (1, 0)
    assert spec.violated_invariants(pool.to_spec()) == []
    assert pool.usage().free_blocks == 0
    pool.release("b")
    assert pool.usage().free_blocks == 2


def test_every_event_of_a_call_is_offered_and_the_first_error_is_raised_with_a_note() -> None:
    offered: list[KVCacheEvent] = []

    def sink(event: KVCacheEvent) -> None:
        offered.append(event)
        raise SinkError(len(offered))

    pool = KVCacheManager(8, 2, event_sink=sink)
    with pytest.raises(SinkError) as raised:
        pool.allocate("a", [1, 2, 3, 4, 5])
    assert offered == [
        BlockStored(0, 0, None, (1, 2), None),
        BlockStored(1, 0, 0, (3, 4), None),
    ]
    assert raised.value.args == (1,)
    assert raised.value.__notes__ == ["the event sink raised on 2 of the call's 2 events"]
    assert pool.tables("a")[0].token_count == 5


def test_a_sink_that_raised_once_gets_its_error_back_without_a_note() -> None:
    offered: list[KVCacheEvent] = []

    def sink(event: KVCacheEvent) -> None:
        offered.append(event)
        if len(offered) == 1:
            raise SinkError(len(offered))

    pool = KVCacheManager(8, 2, event_sink=sink)
    with pytest.raises(SinkError) as raised:
        pool.allocate("a", [1, 2, 3, 4, 5])
    assert len(offered) == 2
    assert not hasattr(raised.value, "__notes__")
