"""Preemption: the one loop that grows every running request, making room by preempting
the most recently admitted, and the one call that preempts a victim (by swap or recompute).

Both allocator benchmarks (``harness.bench.allocator``, ``harness.bench.prefix``) run the
loop, what "grow" means theirs; the engine runs its rule without callbacks
(``Scheduler.grow`` hands each victim back, the engine preempts it). The engine's host tier
(``harness.runtime.host_tier``) and ``harness.bench.prefix`` preempt with the call; what a
victim's copies move is theirs. Torch-free.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from impl import KVCacheManager, Transfers
from spec import BlockAllocationError

Running = TypeVar("Running")

# How a victim gives its device blocks back: ``recompute`` drops its K/V (it is admitted
# again with its tokens as a prompt), ``swap`` copies them to the host tier first (it is
# swapped back in and resumes), falling back to recompute when the host tier is short.
PreemptMode = Literal["recompute", "swap"]
PREEMPT_MODES: tuple[PreemptMode, ...] = ("recompute", "swap")


@dataclass(frozen=True, slots=True)
class Preempted:
    """How a victim was preempted: ``swapped`` (else recomputed), the transfers the caller
    makes in its store at once (its copies out among them), and the device blocks it let
    go of that are free now and hold no cached prefix (a poisoned pool fills them, after
    the transfers)."""

    swapped: bool
    transfers: Transfers
    freed_block_ids: tuple[int, ...]


def preempt_request(manager: KVCacheManager, request_id: str, mode: PreemptMode) -> Preempted:
    """Preempt ``request_id`` by ``mode``, then take every pending transfer.

    The transfers are taken at once, so the blocks the victim gave up are free by return: a
    device block with a pending copy out of it is handed to no one until the copy is taken
    (the manager's pending-copy rule), and the caller retries an append on those blocks.
    Whatever the victim held is free only once the caller has made the transfers, so a
    poisoned pool fills ``freed_block_ids`` after them.
    """
    swapped = False
    if mode == "swap":
        try:
            freed = manager.swap_out(request_id).freed_block_ids
            swapped = True
        except BlockAllocationError:
            pass  # the host tier is short: the refusal changed nothing, recompute instead
    if not swapped:
        freed = manager.preempt(request_id).freed_block_ids
    return Preempted(swapped, manager.take_transfers(), freed)


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
