"""Named invariants of an allocator state: each an ``is_*`` predicate with its rule in one line.

``violated_invariants`` runs them all and names the broken ones, so a failing test says
which rule broke, not just that one did.
"""

from collections.abc import Callable

from spec.allocator import AllocatorState, blocks_for_tokens, usage
from spec.records import KVBlockUsage


def is_conserved(state: AllocatorState) -> bool:
    """Conservation: free blocks plus blocks held by tables equal total_blocks."""
    held = sum(len(table.block_ids) for table in state.tables.values())
    return len(state.free_block_ids) + held == state.total_blocks


def is_partitioned(state: AllocatorState) -> bool:
    """Every block id in range sits exactly once, either in the free queue or in one table."""
    seen = list(state.free_block_ids)
    for table in state.tables.values():
        seen.extend(table.block_ids)
    return sorted(seen) == list(range(state.total_blocks))


def is_tightly_sized(state: AllocatorState) -> bool:
    """Every table holds exactly ceil(token_count / block_size) blocks, no more, no fewer."""
    return all(
        table.token_count >= 0
        and len(table.block_ids) == blocks_for_tokens(state.block_size, table.token_count)
        for table in state.tables.values()
    )


def is_keyed_by_request_id(state: AllocatorState) -> bool:
    """Every table is filed under its own request id."""
    return all(key == table.request_id for key, table in state.tables.items())


def is_usage_consistent(state: AllocatorState, report: KVBlockUsage) -> bool:
    """A usage report agrees with the tables: blocks, requests and tokens all add up."""
    return report == usage(state) and report.used_blocks + report.free_blocks == state.total_blocks


INVARIANTS: dict[str, Callable[[AllocatorState], bool]] = {
    "conservation": is_conserved,
    "partition": is_partitioned,
    "tight_sizing": is_tightly_sized,
    "keyed_by_request_id": is_keyed_by_request_id,
}


def violated_invariants(state: AllocatorState) -> list[str]:
    """The names of the invariants that ``state`` breaks (empty when it is sound)."""
    return [name for name, holds in INVARIANTS.items() if not holds(state)]
