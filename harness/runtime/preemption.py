"""Preemption by recompute: the one loop that grows every running request, making room by
preempting the most recently admitted.

The engine and both allocator benchmarks (``harness.bench.allocator``,
``harness.bench.prefix``) run it; what "grow" and "preempt" mean is theirs. Torch-free.
"""

from collections.abc import Callable
from typing import TypeVar

from spec import BlockAllocationError

Running = TypeVar("Running")


def append_or_preempt(
    running: list[Running],
    append: Callable[[Running], object],
    preempt: Callable[[Running], None],
) -> None:
    """Call ``append`` on each of ``running`` (admission order); when the pool is dry
    (``BlockAllocationError``), preempt the victim, the most recently admitted (removed
    from the end of ``running``), and try the same request again.

    A victim has not appended yet this step, or it is the request whose append failed
    (then the loop ends). Victims are preempted last admitted first, so a caller that
    puts each back at the head of its waiting queue keeps them in admission order.
    """
    index = 0
    while index < len(running):
        try:
            append(running[index])
        except BlockAllocationError:
            preempt(running.pop())
            continue
        index += 1
