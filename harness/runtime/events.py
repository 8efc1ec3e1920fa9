"""What an observer of the pool hears from the engine: an event, and the manager after it.

An engine always has an observer; by default ``ignore_pool_events``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from impl import KVCacheManager

PoolEventKind = Literal["step", "preempt", "swap_out", "swap_in", "fork", "release"]


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """A moment an observer of the pool is told of: the end of a step (after the forward,
    before finished requests release), or a preemption (by recompute), swap out, swap in,
    fork or release just done.

    ``request_ids``: none for a step, the parent then the child for a fork, else the one.
    """

    kind: PoolEventKind
    step: int
    request_ids: tuple[str, ...] = ()


# Called with each event and the manager after it; it must only read the manager.
PoolObserver = Callable[[PoolEvent, KVCacheManager], None]


def ignore_pool_events(event: PoolEvent, manager: KVCacheManager) -> None:
    """The default observer: hears every event and does nothing."""
