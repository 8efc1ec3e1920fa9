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
from collections.abc import Callable, Iterator, Mapping
from itertools import combinations

from spec.host_tier import copying_in_host_block_ids, demoting_block_ids, pinned_block_ids
from spec.kinds import RecurrentState, attention_window, is_state_group
from spec.records import CacheKey, KVBlockUsage, RequestBlockTable
from spec.rules import blocks_for_tokens, first_window_token
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


def _attention_tables(state: AllocatorState) -> Iterator[RequestBlockTable]:
    for kind, tables in zip(state.group_windows, state.group_tables, strict=True):
        if not is_state_group(kind):
            yield from tables.values()


def is_tightly_sized(state: AllocatorState) -> bool:
    """Every table of an attention group holds exactly ceil(token_count / block_size) -
    skipped_blocks blocks (a state group's: ``is_state_table_single``)."""
    return all(
        table.token_count >= 0
        and table.skipped_blocks >= 0
        and table.skipped_blocks + len(table.block_ids)
        == blocks_for_tokens(state.block_size, table.token_count)
        for table in _attention_tables(state)
    )


def is_keyed_by_request_id(state: AllocatorState) -> bool:
    """Every table is filed under its own request id."""
    return all(
        key == table.request_id for tables in state.group_tables for key, table in tables.items()
    )


def is_grouped_consistently(state: AllocatorState) -> bool:
    """One table and one cache per group; every group has a table for the same requests,
    with the same token count; a full-attention or state group never skips; a block sits in one
    group's tables and cache at most."""
    if not _has_one_entry_per_group(state):
        return False
    counts = {request_id: t.token_count for request_id, t in state.tables.items()}
    for group, tables in enumerate(state.group_tables):
        if {request_id: t.token_count for request_id, t in tables.items()} != counts:
            return False
        window = attention_window(state.group_windows[group])
        if window is None and any(t.skipped_blocks for t in tables.values()):
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
    """No hole is read: a table in a group with window W skipped only blocks the next query
    (at position token_count) cannot read, skipped_blocks * block_size <= max(0,
    token_count - W + 1)."""
    for kind, tables in zip(state.group_windows, state.group_tables, strict=True):
        window = attention_window(kind)
        if window is None:
            continue
        for table in tables.values():
            if table.skipped_blocks * state.block_size > first_window_token(
                table.token_count, window
            ):
                return False
    return True


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


def is_cached_content_exact(state: AllocatorState) -> bool:
    """A cached block in an attention group's table sits where its key ends, and the table's
    tokens equal the key, or begin it where the table ends in that block (a rollback kept
    the key: ``spec.releasing.truncate``) (a state group's: ``is_checkpoint_unwritten``)."""
    for kind, tables, cache in zip(
        state.group_windows, state.group_tables, state.group_caches, strict=True
    ):
        if is_state_group(kind):
            continue
        prefix_of = {block_id: key for key, block_id in cache.items()}
        for request_id, table in tables.items():
            ids = state.token_ids.get(request_id)
            for index, block_id in enumerate(table.block_ids, start=table.skipped_blocks):
                key = prefix_of.get(block_id)
                if key is None:
                    continue
                if ids is None or len(key.token_ids) != (index + 1) * state.block_size:
                    return False
                if ids != key.token_ids[: len(ids)] and ids[: len(key.token_ids)] != key.token_ids:
                    return False
    return True


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


def is_shared_only_over_a_common_prefix(state: AllocatorState) -> bool:
    """Two tables share a block only at the same index, over the same content before it.

    The same content is the same tokens where both tables track them: two requests may
    reach a shared block through different blocks holding equal tokens (a prefix hit
    after one of them computed a duplicate of a cached block). Where either is tracked by
    count, the only way to share is a fork, so the blocks before must be the very same
    (where both still hold them). Indices are block indices: a table's ``block_ids[i]`` is index
    ``skipped_blocks + i``. A state group's sharing is ``is_state_shared_only_by_forks``'.
    """
    for kind, tables in zip(state.group_windows, state.group_tables, strict=True):
        if is_state_group(kind):
            continue
        for first, second in combinations(tables.values(), 2):
            if not _is_shared_soundly(state, first, second):
                return False
    return True


def _is_shared_soundly(
    state: AllocatorState, first: RequestBlockTable, second: RequestBlockTable
) -> bool:
    common = set(first.block_ids) & set(second.block_ids)
    if not common:
        return True
    first_index = {b: first.skipped_blocks + i for i, b in enumerate(first.block_ids)}
    second_index = {b: second.skipped_blocks + i for i, b in enumerate(second.block_ids)}
    if any(first_index[b] != second_index[b] for b in common):
        return False
    depth = max(first_index[b] for b in common) + 1
    first_ids = state.token_ids.get(first.request_id)
    second_ids = state.token_ids.get(second.request_id)
    if first_ids is None or second_ids is None:
        # Both hold the blocks from the later of their skipped_blocks on.
        start = max(first.skipped_blocks, second.skipped_blocks)
        return (
            first.block_ids[start - first.skipped_blocks : depth - first.skipped_blocks]
            == second.block_ids[start - second.skipped_blocks : depth - second.skipped_blocks]
        )
    end = min(depth * state.block_size, len(first_ids), len(second_ids))
    return first_ids[:end] == second_ids[:end]


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


def _state_groups(
    state: AllocatorState,
) -> Iterator[tuple[RecurrentState, Mapping[str, RequestBlockTable], Mapping[CacheKey, int]]]:
    for kind, tables, cache in zip(
        state.group_windows, state.group_tables, state.group_caches, strict=True
    ):
        if isinstance(kind, RecurrentState):
            yield kind, tables, cache


def is_state_table_single(state: AllocatorState) -> bool:
    """Every table of a state group holds exactly one block, its running state, and skips
    none, whatever its length (``spec.kinds``)."""
    return all(
        len(table.block_ids) == 1 and table.skipped_blocks == 0
        for _, tables, _ in _state_groups(state)
        for table in tables.values()
    )


def is_checkpoint_unwritten(state: AllocatorState) -> bool:
    """A state group's cached block (a checkpoint) is held only by tables whose token ids
    and salt are exactly its key's: the write rule copies it before any table adds to it,
    so a cached state is never written again."""
    for _, tables, cache in _state_groups(state):
        key_of = {block_id: key for key, block_id in cache.items()}
        for table in tables.values():
            key = key_of.get(table.block_ids[0]) if table.block_ids else None
            if key is None:
                continue
            ids = state.token_ids.get(table.request_id)
            if ids != key.token_ids or state.cache_salts.get(table.request_id) != key.cache_salt:
                return False
    return True


def is_checkpoint_on_grid(state: AllocatorState) -> bool:
    """Every checkpoint a state group caches is keyed by a prefix whose length is a
    positive multiple of the group's interval: the tokens its state is after."""
    return all(
        len(key.token_ids) > 0 and len(key.token_ids) % kind.interval == 0
        for kind, _, cache in _state_groups(state)
        for key in cache
    )


def is_state_shared_only_by_forks(state: AllocatorState) -> bool:
    """Two tables of a state group share their block only at the same length, over the
    same token ids where both track them: a fork neither side has added to since."""
    for _, tables, _ in _state_groups(state):
        for first, second in combinations(tables.values(), 2):
            if first.block_ids != second.block_ids:
                continue
            if first.token_count != second.token_count:
                return False
            first_ids = state.token_ids.get(first.request_id)
            second_ids = state.token_ids.get(second.request_id)
            if first_ids is not None and second_ids is not None and first_ids != second_ids:
                return False
    return True


def is_state_hit_exact(
    before: AllocatorState, after: AllocatorState, request_id: str, cached_tokens: int
) -> bool:
    """The hit rule in a state group, for one admission: after ``allocate`` gave
    ``request_id`` a hit of ``cached_tokens`` (h), its block in each state group is fresh
    when h is 0, and otherwise the destination of a copy whose source ``before`` cached
    under exactly its salt and first h token ids (never an earlier checkpoint). An
    operation property, as ``is_window_tight``: the state records no admission."""
    copies = dict((d, s) for s, d in after.pending_copies)
    for group, kind in enumerate(after.group_windows):
        if not is_state_group(kind):
            continue
        (block_id,) = after.group_tables[group][request_id].block_ids
        if cached_tokens == 0:
            if block_id in copies:
                return False
            continue
        token_ids = after.token_ids.get(request_id, ())
        key = CacheKey(after.cache_salts.get(request_id), token_ids[:cached_tokens])
        if copies.get(block_id) != before.group_caches[group].get(key, -1):
            return False
    return True


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
    "salt_isolated": is_salt_isolated,
    "shared_over_common_prefix": is_shared_only_over_a_common_prefix,
    "copy_destination_held": is_copy_destination_held,
    "grouped_consistently": is_grouped_consistently,
    "window_readable": is_window_readable,
    "skipped_pending_free": is_skipped_pending_free,
    "host_partition": is_host_partitioned,
    "swapped_sound": is_swapped_sound,
    "copy_source_in_flight": is_copy_source_in_flight,
    "state_table_single": is_state_table_single,
    "checkpoint_unwritten": is_checkpoint_unwritten,
    "checkpoint_on_grid": is_checkpoint_on_grid,
    "state_shared_only_by_forks": is_state_shared_only_by_forks,
}


def violated_invariants(state: AllocatorState) -> list[str]:
    """The names of the invariants that ``state`` breaks (empty when it is sound). A state
    without one table and one cache per group breaks ``grouped_consistently`` and is
    checked no further: the other rules pair the groups' lists."""
    if not _has_one_entry_per_group(state):
        return ["grouped_consistently"]
    return [name for name, holds in INVARIANTS.items() if not holds(state)]
