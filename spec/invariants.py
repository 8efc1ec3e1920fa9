"""Named invariants of an allocator state: each an ``is_*`` predicate with its rule in one line.

``violated_invariants`` runs them all and names the broken ones, so a failing test says
which rule broke, not just that one did. Each holds in every KV cache group.

One rule is not a property of a state alone: "no windowed table holds a block wholly
outside its window" depends on where the last adding operation put the computed tokens
(L0), which the state does not record. ``is_window_tight`` states it for one request and
one L0; the state machine and the bounded checker apply it after every adding step. The
state invariant ``is_window_readable`` is its other half: no table skipped a block the
next query may read.
"""

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spec.host_tier import copying_in_host_block_ids, demoting_block_ids, pinned_block_ids
from spec.kinds import KIND_EXAMPLES, copies_hit
from spec.records import GroupView, KVBlockUsage, RequestBlockTable
from spec.rules import blocks_for_tokens
from spec.state import AllocatorState, compute_skipped_blocks, usage


def _all_tables(state: AllocatorState) -> Iterator[RequestBlockTable]:
    for tables in state.group_tables:
        yield from tables.values()


def _held_block_ids(state: AllocatorState) -> set[int]:
    return {block_id for table in _all_tables(state) for block_id in table.block_ids}


def _in_flight(state: AllocatorState) -> tuple[int, ...]:
    return state.host.in_flight_block_ids


def is_conserved(state: AllocatorState) -> bool:
    """Conservation: free + cached free + distinct blocks held by tables + blocks in flight
    (read by a pending copy to the host, held by no table) = total_blocks."""
    free = len(state.free_block_ids) + len(state.cached_free_block_ids)
    return free + len(_held_block_ids(state)) + len(_in_flight(state)) == state.total_blocks


def is_partitioned(state: AllocatorState) -> bool:
    """Every block id sits exactly once in the free queue, the cached free queue, the tables
    or in flight."""
    seen = [
        *state.free_block_ids,
        *state.cached_free_block_ids,
        *_held_block_ids(state),
        *_in_flight(state),
    ]
    return sorted(seen) == list(range(state.total_blocks))


def is_duplicate_free(state: AllocatorState) -> bool:
    """No table holds the same block twice."""
    return all(len(set(t.block_ids)) == len(t.block_ids) for t in _all_tables(state))


def is_ref_counted(state: AllocatorState) -> bool:
    """Each block's ref count equals the number of tables holding it (free blocks: none)."""
    holders = Counter(b for table in _all_tables(state) for b in table.block_ids)
    return dict(holders) == dict(state.ref_counts)


def is_tightly_sized(state: AllocatorState) -> bool:
    """Every table holds the blocks its group's kind sizes it to (``is_table_sized``): an
    attention group's ceil(token_count / block_size) - skipped_blocks, a state group's
    one running block."""
    return all(
        kind.is_table_sized(state.block_size, table)
        for kind, tables in zip(state.group_windows, state.group_tables, strict=True)
        for table in tables.values()
    )


def is_keyed_by_request_id(state: AllocatorState) -> bool:
    """Every table is filed under its own request id."""
    return all(
        key == table.request_id for tables in state.group_tables for key, table in tables.items()
    )


def is_grouped_consistently(state: AllocatorState) -> bool:
    """One table and one cache per group; every group has a table for the same requests,
    with the same token count; a block sits in one group's tables and cache at most. (What
    a group may skip is ``is_window_readable``'s.)"""
    if not _has_one_entry_per_group(state):
        return False
    counts = {request_id: t.token_count for request_id, t in state.tables.items()}
    for tables in state.group_tables:
        if {request_id: t.token_count for request_id, t in tables.items()} != counts:
            return False
    owners = [
        {b for t in tables.values() for b in t.block_ids} | set(state.group_caches[group].values())
        for group, tables in enumerate(state.group_tables)
    ]
    return sum(len(blocks) for blocks in owners) == len(set().union(*owners))


def _has_one_entry_per_group(state: AllocatorState) -> bool:
    """The per-group lists (windows, tables, caches) are equally long. The predicates that
    pair them group by group raise ValueError on a state where they are not."""
    groups = len(state.group_windows)
    return len(state.group_tables) == len(state.group_caches) == groups


def is_window_readable(state: AllocatorState) -> bool:
    """No hole is read: a table skipped only blocks the next query (at position
    token_count) cannot read, skipped_blocks * block_size <= its kind's
    ``first_read(token_count)`` (max(0, token_count - W + 1) with a window of W; 0, so
    nothing skipped, in a full-attention or state group)."""
    return all(
        table.skipped_blocks * state.block_size <= kind.first_read(table.token_count)
        for kind, tables in zip(state.group_windows, state.group_tables, strict=True)
        for table in tables.values()
    )


def is_window_tight(state: AllocatorState, request_id: str, computed_tokens: int) -> bool:
    """No windowed table holds a block wholly outside its window: after an operation that
    added tokens to ``request_id`` with its first ``computed_tokens`` (L0) computed, every
    block index b its table holds in a group with window W has (b + 1) * block_size >
    L0 - W + 1, and it skipped only those: skipped_blocks == max(0, L0 - W + 1) //
    block_size (blocks are held from index skipped_blocks on, without gaps)."""
    return all(
        tables[request_id].skipped_blocks == compute_skipped_blocks(state, group, computed_tokens)
        for group, tables in enumerate(state.group_tables)
        if state.group_windows[group] is not None
    )


def is_skipped_pending_free(state: AllocatorState) -> bool:
    """Blocks windows skipped that wait for ``take_transfers`` are free (uncached) and
    listed once each."""
    pending = state.pending_skipped_block_ids
    return len(set(pending)) == len(pending) and set(pending) <= set(state.free_block_ids)


def is_token_tracking_sound(state: AllocatorState) -> bool:
    """A request that tracks token ids has exactly token_count of them."""
    return all(
        request_id in state.tables and len(ids) == state.tables[request_id].token_count
        for request_id, ids in state.token_ids.items()
    )


def is_cache_sound(state: AllocatorState) -> bool:
    """Cache keys are whole-block prefixes, one block each; cached free blocks are cached."""
    cached = [block_id for cache in state.group_caches for block_id in cache.values()]
    keys = [key for cache in state.group_caches for key in cache]
    return (
        len(set(cached)) == len(cached)
        and all(
            len(key.token_ids) > 0 and len(key.token_ids) % state.block_size == 0 for key in keys
        )
        and set(state.cached_free_block_ids) <= set(cached)
        and not set(state.free_block_ids) & set(cached)
    )


def is_salt_isolated(state: AllocatorState) -> bool:
    """A table holds a cached block only if it is cached under the table's own salt: a hit
    never crosses salts, and a fork keeps its parent's salt."""
    for tables, cache in zip(state.group_tables, state.group_caches, strict=True):
        salt_of = {block_id: key.cache_salt for key, block_id in cache.items()}
        for request_id, table in tables.items():
            salt = state.cache_salts.get(request_id)
            if any(salt_of.get(b, salt) != salt for b in table.block_ids):
                return False
    return set(state.cache_salts) <= set(state.token_ids)


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
        and report.used_blocks == len(_held_block_ids(state)) + len(_in_flight(state))
        and report.used_blocks + report.free_blocks == state.total_blocks
    )


def is_host_partitioned(state: AllocatorState) -> bool:
    """Every host block id sits exactly once in the host free queue, a swapped-out
    request's blocks, the host-cached blocks, or among the sources of pending
    (host -> device) copies that are not host-cached; the host caches (one per group, or
    none in a state built by hand without a host tier) hold the host-cached blocks, one
    key each."""
    host = state.host
    cached = host.host_cached_block_ids
    keyed = [h for cache in host.host_caches for h in cache.values()]
    copying_in = [h for h in copying_in_host_block_ids(host) if h not in cached]
    swapped = [h for record in host.swapped.values() for h in record.host_block_ids]
    seen = [*host.free_host_block_ids, *swapped, *cached, *copying_in]
    return (
        sorted(seen) == list(range(host.host_blocks))
        and sorted(keyed) == sorted(cached)
        and len(host.host_caches) in {0, len(state.group_windows)}
        and (host.host_prefix_cache or not cached)
    )


def is_swapped_sound(state: AllocatorState) -> bool:
    """A swapped-out request holds no device block and is sized as it was: per group,
    skipped_blocks + host blocks = ceil(token_count / block_size); it tracks exactly
    token_count token ids, or none; a salt only with token ids."""
    for request_id, record in state.host.swapped.items():
        if request_id in state.tables or request_id in state.token_ids:
            return False
        group_count = len(state.group_windows)
        if not len(record.group_host_block_ids) == len(record.group_skipped_blocks) == group_count:
            return False
        blocks = blocks_for_tokens(state.block_size, record.token_count)
        for group, held in enumerate(record.group_host_block_ids):
            if record.group_skipped_blocks[group] + len(held) != blocks:
                return False
        if record.token_ids is not None and len(record.token_ids) != record.token_count:
            return False
        if record.token_ids is None and record.cache_salt is not None:
            return False
    return True


def is_copy_source_in_flight(state: AllocatorState) -> bool:
    """The pending-copy rule: a device block a pending copy pins (a swap-out's copy to the
    host reads it, or a copy from the host writes it) is held by a table or in flight,
    never in a free queue, and the in-flight blocks are exactly the unheld ones; a block a
    pending demotion reads is held, cached free or in flight (a swap-out's copy pins it
    too); each copy out writes into a host block a swapped-out request holds, the host
    caches or a pending copy back reads (a request swapped in before its copies out were
    taken); no device block is the destination of two copies (of either kind)."""
    host = state.host
    queued = set(state.free_block_ids) | set(state.cached_free_block_ids)
    pinned = pinned_block_ids(host)
    swapped = {h for record in host.swapped.values() for h in record.host_block_ids}
    kept = swapped | set(host.host_cached_block_ids) | set(copying_in_host_block_ids(host))
    destinations = [d for _, d in state.pending_copies] + [
        d for _, d in host.pending_host_to_device
    ]
    host_destinations = [h for _, h in host.pending_device_to_host]
    held = _held_block_ids(state)
    in_flight = host.in_flight_block_ids
    return (
        not pinned & queued
        and demoting_block_ids(host) <= held | set(state.cached_free_block_ids) | set(in_flight)
        and len(set(in_flight)) == len(in_flight)
        and set(in_flight) == {d for d in pinned if d not in held}
        and all(h in kept for h in host_destinations)
        and len(set(host_destinations)) == len(host_destinations)
        and not any(d in queued for _, d in host.pending_host_to_device)
        and len(set(destinations)) == len(destinations)
    )


def is_state_hit_exact(
    before: AllocatorState, after: AllocatorState, request_id: str, cached_tokens: int
) -> bool:
    """The hit rule where a kind's write rule copies the hit (a state group), for one
    admission: after ``allocate`` gave ``request_id`` a hit of ``cached_tokens`` (h), no
    block of a group's new table is a copy's destination when its kind's hit needs no key
    (h = 0), and where the tokens past the hit write into its last block and the kind
    copies that cached block first, the table holds there the destination of a copy whose
    source ``before`` cached under exactly that key (a state group: its salt and first h
    token ids, never an earlier checkpoint). An operation property, as
    ``is_window_tight``: the state records no admission."""
    copies = dict((d, s) for s, d in after.pending_copies)
    token_ids = after.token_ids.get(request_id, ())
    salt = after.cache_salts.get(request_id)
    block_size = after.block_size
    for group, kind in enumerate(after.group_windows):
        table = after.group_tables[group][request_id]
        keys = kind.hit_keys(block_size, token_ids, cached_tokens, salt)
        if not keys:
            if any(block_id in copies for block_id in table.block_ids):
                return False
            continue
        if copies_hit(kind, block_size, cached_tokens):
            block_id = table.block_ids[len(keys) - 1]
            if copies.get(block_id) != before.group_caches[group].get(keys[-1], -1):
                return False
    return True


def _group_views(
    state: AllocatorState,
) -> Iterator[tuple[str, Callable[[GroupView], bool], GroupView]]:
    """Each group's own invariants (its kind's ``invariants``), with the group to check."""
    for kind, tables, cache in zip(
        state.group_windows, state.group_tables, state.group_caches, strict=True
    ):
        view = GroupView(state.block_size, tables, cache, state.token_ids, state.cache_salts)
        for name, holds in kind.invariants().items():
            yield name, holds, view


@dataclass(frozen=True, slots=True)
class _KindInvariant:
    """The state predicate of the kinds' invariant ``name``: it holds in every group whose
    kind keeps it. (A class, not a closure made at import: its rule runs when called.)"""

    name: str

    def __call__(self, state: AllocatorState) -> bool:
        return all(holds(view) for kept, holds, view in _group_views(state) if kept == self.name)


# The kinds' own invariants (``GroupKind.invariants``), by name, over every registered kind.
KIND_INVARIANT_NAMES = tuple(
    dict.fromkeys(name for kind in KIND_EXAMPLES for name in kind.invariants())
)
is_cached_content_exact = _KindInvariant("cached_content_exact")
is_shared_only_over_a_common_prefix = _KindInvariant("shared_over_common_prefix")
is_checkpoint_unwritten = _KindInvariant("checkpoint_unwritten")
is_checkpoint_on_grid = _KindInvariant("checkpoint_on_grid")
is_state_shared_only_by_forks = _KindInvariant("state_shared_only_by_forks")


INVARIANTS: dict[str, Callable[[AllocatorState], bool]] = {
    "conservation": is_conserved,
    "partition": is_partitioned,
    "duplicate_free_tables": is_duplicate_free,
    "ref_counts": is_ref_counted,
    "tight_sizing": is_tightly_sized,
    "keyed_by_request_id": is_keyed_by_request_id,
    "token_tracking": is_token_tracking_sound,
    "cache_sound": is_cache_sound,
    "salt_isolated": is_salt_isolated,
    "copy_destination_held": is_copy_destination_held,
    "grouped_consistently": is_grouped_consistently,
    "window_readable": is_window_readable,
    "skipped_pending_free": is_skipped_pending_free,
    "host_partition": is_host_partitioned,
    "swapped_sound": is_swapped_sound,
    "copy_source_in_flight": is_copy_source_in_flight,
    **{name: _KindInvariant(name) for name in KIND_INVARIANT_NAMES},
}


def violated_invariants(state: AllocatorState) -> list[str]:
    """The names of the invariants that ``state`` breaks (empty when it is sound). A state
    without one table and one cache per group breaks ``grouped_consistently`` and is
    checked no further: the other rules pair the groups' lists."""
    if not _has_one_entry_per_group(state):
        return ["grouped_consistently"]
    return [name for name, holds in INVARIANTS.items() if not holds(state)]
