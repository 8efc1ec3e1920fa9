"""Named invariants of an allocator state: each an ``is_*`` predicate with its rule in one line.

``violated_invariants`` runs them all and names the broken ones, so a failing test says
which rule broke, not just that one did.
"""

from collections import Counter
from collections.abc import Callable
from itertools import combinations

from spec.allocator import AllocatorState, blocks_for_tokens, usage
from spec.records import KVBlockUsage


def _held_block_ids(state: AllocatorState) -> set[int]:
    return {block_id for table in state.tables.values() for block_id in table.block_ids}


def is_conserved(state: AllocatorState) -> bool:
    """Conservation: free + cached free + distinct blocks held by tables = total_blocks."""
    free = len(state.free_block_ids) + len(state.cached_free_block_ids)
    return free + len(_held_block_ids(state)) == state.total_blocks


def is_partitioned(state: AllocatorState) -> bool:
    """Every block id sits exactly once in the free queue, the cached free queue or the tables."""
    seen = [*state.free_block_ids, *state.cached_free_block_ids, *_held_block_ids(state)]
    return sorted(seen) == list(range(state.total_blocks))


def is_duplicate_free(state: AllocatorState) -> bool:
    """No table holds the same block twice."""
    return all(len(set(t.block_ids)) == len(t.block_ids) for t in state.tables.values())


def is_ref_counted(state: AllocatorState) -> bool:
    """Each block's ref count equals the number of tables holding it (free blocks: none)."""
    holders = Counter(b for table in state.tables.values() for b in table.block_ids)
    return dict(holders) == dict(state.ref_counts)


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


def is_token_tracking_sound(state: AllocatorState) -> bool:
    """A request that tracks token ids has exactly token_count of them."""
    return all(
        request_id in state.tables and len(ids) == state.tables[request_id].token_count
        for request_id, ids in state.token_ids.items()
    )


def is_cache_sound(state: AllocatorState) -> bool:
    """Cache keys are whole-block prefixes, one block each; cached free blocks are cached."""
    cached = list(state.cache.values())
    return (
        len(set(cached)) == len(cached)
        and all(len(key) > 0 and len(key) % state.block_size == 0 for key in state.cache)
        and set(state.cached_free_block_ids) <= set(cached)
        and not set(state.free_block_ids) & set(cached)
    )


def is_cached_content_exact(state: AllocatorState) -> bool:
    """A cached block in a table sits where its key ends, and the table's tokens equal the key."""
    prefix_of = {block_id: key for key, block_id in state.cache.items()}
    for request_id, table in state.tables.items():
        ids = state.token_ids.get(request_id)
        for index, block_id in enumerate(table.block_ids):
            key = prefix_of.get(block_id)
            if key is None:
                continue
            if ids is None or len(key) != (index + 1) * state.block_size:
                return False
            if ids[: len(key)] != key:
                return False
    return True


def is_shared_only_over_a_common_prefix(state: AllocatorState) -> bool:
    """Two tables share a block only at the same index, over the same content before it.

    The same content is the same tokens where both tables track them: two requests may
    reach a shared block through different blocks holding equal tokens (a prefix hit
    after one of them computed a duplicate of a cached block). Where either is tracked by
    count, the only way to share is a fork, so the blocks before must be the very same.
    """
    for first, second in combinations(state.tables.values(), 2):
        common = set(first.block_ids) & set(second.block_ids)
        if not common:
            continue
        if any(first.block_ids.index(b) != second.block_ids.index(b) for b in common):
            return False
        depth = max(first.block_ids.index(b) for b in common) + 1
        first_ids = state.token_ids.get(first.request_id)
        second_ids = state.token_ids.get(second.request_id)
        if first_ids is None or second_ids is None:
            if first.block_ids[:depth] != second.block_ids[:depth]:
                return False
            continue
        end = min(depth * state.block_size, len(first_ids), len(second_ids))
        if first_ids[:end] != second_ids[:end]:
            return False
    return True


def is_copy_destination_held(state: AllocatorState) -> bool:
    """A pending copy writes into a block a table holds, and no block gets two copies."""
    destinations = [destination for _, destination in state.pending_copies]
    return len(set(destinations)) == len(destinations) and all(
        destination in state.ref_counts for destination in destinations
    )


def is_usage_consistent(state: AllocatorState, report: KVBlockUsage) -> bool:
    """A usage report agrees with the tables: blocks, requests and tokens all add up."""
    return (
        report == usage(state)
        and report.used_blocks == len(_held_block_ids(state))
        and report.used_blocks + report.free_blocks == state.total_blocks
    )


INVARIANTS: dict[str, Callable[[AllocatorState], bool]] = {
    "conservation": is_conserved,
    "partition": is_partitioned,
    "duplicate_free_tables": is_duplicate_free,
    "ref_counts": is_ref_counted,
    "tight_sizing": is_tightly_sized,
    "keyed_by_request_id": is_keyed_by_request_id,
    "token_tracking": is_token_tracking_sound,
    "cache_sound": is_cache_sound,
    "cached_content_exact": is_cached_content_exact,
    "shared_over_common_prefix": is_shared_only_over_a_common_prefix,
    "copy_destination_held": is_copy_destination_held,
}


def violated_invariants(state: AllocatorState) -> list[str]:
    """The names of the invariants that ``state`` breaks (empty when it is sound)."""
    return [name for name, holds in INVARIANTS.items() if not holds(state)]
