"""``SpecBackedManager``: ``KVCacheManager``'s API with the spec behind it, for tests and the
spec row of the allocator benchmark; not part of ``impl``'s public API (import it from
``impl.spec_backed``). ``as_impl`` is the one place spec's records map onto impl's.

It has no method of its own per operation: every row of ``spec.api.OPERATIONS`` is an
attribute that threads an immutable spec state through the row's transition and hands
back the record impl hands out; it decides nothing itself. The KV cache events a call
emits leave the state and go to ``event_sink`` once the state has changed, as impl's do
(``impl.events``). So a scenario written against the manager runs on the spec unchanged,
and the spec-side benchmark times exactly what the specification does. Slow on purpose:
O(pool) per call.
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import spec
from impl.events import deliver_events
from impl.prefix_cache import EventSink
from impl.records import AppendedSlots
from spec import AllocatorState, GroupEntry, GroupKind, take_events
from spec.api import OPERATIONS


def as_impl(value: object) -> object:
    """``value`` as impl hands it out: a spec ``AppendedSlots`` as impl's named tuple, any
    other value as it is (impl hands out spec's other records)."""
    if isinstance(value, spec.AppendedSlots):
        return AppendedSlots(
            value.request_id,
            value.token_count,
            value.block_ids,
            value.skipped_blocks,
            value.slots,
            value.cached_tokens,
        )
    return value


class SpecBackedManager:
    """A mutable handle on a spec state, shaped like ``impl.KVCacheManager``: ``allocate``,
    ``append``, ... are the rows of ``spec.api.OPERATIONS``."""

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: Sequence[GroupEntry] = (None,),
        event_sink: EventSink | None = None,
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
    ) -> None:
        self.state: AllocatorState = spec.init(
            total_blocks, block_size, group_windows, host_blocks, host_prefix_cache
        )
        self.event_sink = event_sink

    def call(self, name: str, *args: object) -> Any:  # Any: the row's own result type
        """Apply the operation ``name`` to the state; return its result as impl would."""
        state, result = OPERATIONS[name].transition(self.state, *args)
        self.state = take_events(state)
        if self.event_sink is not None and state.events:
            deliver_events(self.event_sink, state.events)
        return as_impl(result)

    def __getattr__(self, name: str) -> Callable[..., Any]:  # Any: as ``call``
        if name not in OPERATIONS:
            raise AttributeError(f"{type(self).__name__} has no operation {name!r}")
        return partial(self.call, name)

    @property
    def total_blocks(self) -> int:
        return self.state.total_blocks

    @property
    def block_size(self) -> int:
        return self.state.block_size

    @property
    def group_windows(self) -> tuple[GroupKind, ...]:
        return self.state.group_windows

    def to_spec(self) -> AllocatorState:
        """The spec state (``KVCacheManager.to_spec``'s twin)."""
        return self.state
