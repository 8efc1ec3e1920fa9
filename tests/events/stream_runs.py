"""Runs of the spec's allocator with the stream a publisher of ``translate_events`` sends:
what the event-stream tests drive, and the random runs they draw."""

from collections.abc import Callable

from hypothesis import strategies as st

import spec
from spec import BlockAllocationError
from spec.event_stream import BlockKeys, EventBatch, translate_events
from spec.state import AllocatorState

Op = Callable[[AllocatorState], AllocatorState]

BLOCK_SIZE = 2
Published = list[list[EventBatch]]


def run(ops: list[Op], total_blocks: int = 6) -> tuple[list[AllocatorState], Published]:
    """Apply ``ops`` to an empty pool, a refused one changing nothing; the states (each
    before ``take_events``) and what a publisher of ``translate_events`` sent each step."""
    state = spec.init(total_blocks, BLOCK_SIZE)
    states, published = [state], []
    blocks, seq = BlockKeys(BLOCK_SIZE), 0
    for op in ops:
        try:
            state = op(spec.take_events(state))
        except (BlockAllocationError, KeyError, ValueError):
            state = spec.take_events(state)
        blocks, events = translate_events(blocks, state.events)
        batches = [EventBatch(seq, events)] if events else []
        seq += len(batches)
        states.append(state)
        published.append(batches)
    return states, published


def admit(request_id: str, tokens: tuple[int, ...], salt: str | None = None) -> Op:
    return lambda s: spec.allocate(s, request_id, tokens, salt)


def extend(request_id: str, tokens: tuple[int, ...]) -> Op:
    return lambda s: spec.append(s, request_id, tokens)


def finish(request_id: str) -> Op:
    return lambda s: spec.release(s, request_id)


def reset(state: AllocatorState) -> AllocatorState:
    return spec.reset_prefix_cache(state)


def numbered(published: Published) -> Published:
    """``published`` with its batches numbered 0, 1, ... in order."""
    out: Published = []
    seq = 0
    for batches in published:
        out.append([EventBatch(seq + i, b.events) for i, b in enumerate(batches)])
        seq += len(batches)
    return out


# Small prompts over three token values, so that prefixes are shared and evicted often.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)
request_ids = st.sampled_from("abc")


def operations_with(salts: list[str | None]) -> st.SearchStrategy[Op]:
    """One operation of a run whose prompts take their salt from ``salts``."""
    return st.one_of(
        st.builds(admit, request_ids, tokens, st.sampled_from(salts)),
        st.builds(extend, request_ids, tokens),
        st.builds(finish, request_ids),
        st.just(reset),
    )


operations = operations_with([None, "t"])
