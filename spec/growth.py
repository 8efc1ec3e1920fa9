"""Admission and growth: ``allocate`` gives a new request its blocks, ``append`` adds
tokens to a request, in every KV cache group at once.

A request is allocated either by count (``tokens`` an ``int``: its token ids are not
tracked and its blocks are never cached) or by token ids (``tokens`` a sequence of ids:
its full blocks are cached under its ``cache_salt``, and its prompt reuses the longest
prefix cached under that salt: the hit rule of ``spec.caching``). Each later ``append``
adds tokens of the same kind: a count to the first, token ids to the second.

- The window rule. An operation that adds tokens to a request whose first L0 tokens are
  computed (``append``: L0 = its length before; ``allocate``: 0 by count, the cached
  tokens of its hit by token ids) first releases, in every group with window W, each
  block b with (b + 1) * block_size <= L0 - W + 1: no query at a position >= L0 reads any
  of its keys. So ``skipped_blocks`` becomes max(0, L0 - W + 1) // block_size (vLLM's
  ``SlidingWindowManager.remove_skipped_blocks`` with ``num_computed_tokens`` = L0). The
  blocks go where ``release`` sends a block (never demoted to the host), in block index
  order, group by group, before the operation takes a block; those that became free and
  uncached wait in ``pending_skipped_block_ids`` until ``take_transfers`` (the KV pool
  poisons them), and leave it if an allocation takes them first. The rule applies at
  every call of an adding operation, with zero tokens too.
- Copy-on-write. Appending into a shared, partly filled last block copies it first: the
  writer gets a fresh block and the (source, destination) pair joins ``pending_copies``
  for the KV pool to perform (``take_transfers``). Appending into a partly filled last
  block that is cached (a rollback kept its key: ``spec.releasing.truncate``) and that no
  other table holds forgets its key first (a ``BlockRemoved``): the write changes it.
- A state group (``spec.kinds``) holds one block per request: an adding operation
  checkpoints it at L0 on the group's grid, then copies a cached or shared running block
  into a fresh one (its write rule), and takes no other block.
"""

from collections.abc import Sequence
from dataclasses import replace

from spec.blocks import add_references, hold_in_flight, release_in_order, take_blocks
from spec.caching import (
    cache_checkpoint,
    cache_full_blocks,
    cached_prefix_blocks,
    cached_prefix_tokens,
    checkpoint_key,
    copy_in_from_host,
    hit_keys,
    host_prefix_hits,
)
from spec.errors import (
    BlockAllocationError,
    allocated_by_count,
    check_allocate,
    check_token_count,
    check_token_ids,
    is_token_ids,
    tracks_token_ids,
)
from spec.events import BlockRemoved
from spec.frozen_map import FrozenMap
from spec.kinds import copies_hit
from spec.records import RequestBlockTable
from spec.state import (
    AllocatorState,
    TokenIds,
    compute_skipped_blocks,
    emit,
    free_blocks,
    is_request_known,
    set_cache,
    set_table,
    snapshot_request,
)


def allocate(
    state: AllocatorState,
    request_id: str,
    tokens: int | Sequence[int],
    cache_salt: str | None = None,
) -> AllocatorState:
    """Give a new request blocks for ``tokens``, a count or token ids, in every group
    (group 0's first).

    Checks: ``check_allocate`` (the id, then the tokens and the salt, in the order impl
    refuses them too); enough blocks (BlockAllocationError).
    """
    tokens = check_allocate(
        request_id, tokens, cache_salt, lambda held: is_request_known(state, held)
    )
    if isinstance(tokens, tuple):
        return _allocate_token_ids(state, request_id, tokens, cache_salt)
    per_group = [kind.table_blocks(state.block_size, tokens) for kind in state.group_windows]
    needed = sum(per_group)
    if needed > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, needed, free_blocks(state))
    for group in range(len(state.group_windows)):
        state, taken = take_blocks(state, per_group[group])
        state = set_table(state, group, RequestBlockTable(request_id, taken, tokens))
    return state


def _allocate_token_ids(
    state: AllocatorState, request_id: str, token_ids: TokenIds, cache_salt: str | None
) -> AllocatorState:
    """``allocate`` by token ids (checked): the hit is ``cached_prefix_tokens(state,
    token_ids, cache_salt)`` of the state before; in each group its
    ``cached_prefix_blocks`` gain a reference (a cached free block leaves its queue, an
    in-flight one is held again), the blocks before them are born skipped; then, group by
    group (group 0's first), each of its ``host_prefix_hits`` takes a device block from the
    queues, cached again on the device under its key, with a (host -> device) copy (the
    host keeps its copy), and the blocks past the hit come from the queues; every block
    the prompt fills is cached under ``cache_salt``. Refused (BlockAllocationError) when
    the queues, less the cached free blocks the hit holds again, hold fewer blocks than
    the blocks past the hit and the host hits need. In a state group the hit is the
    checkpoint, held and then copied into the group's one fresh block (``spec.kinds``)."""
    groups = range(len(state.group_windows))
    block_size = state.block_size
    hit_tokens = cached_prefix_tokens(state, token_ids, cache_salt)
    hits = [cached_prefix_blocks(state, token_ids, group, cache_salt) for group in groups]
    host_hits = [host_prefix_hits(state, token_ids, group, cache_salt) for group in groups]
    keys = [hit_keys(state, token_ids, group, cache_salt) for group in groups]
    # The hit's last block is cached; where the prompt's tokens past it write into it (a
    # state group's checkpoint), the kind's write rule may copy it into a fresh block.
    copies = [
        bool(keys[group]) and copies_hit(kind, block_size, hit_tokens)
        for group, kind in enumerate(state.group_windows)
    ]
    per_group = [
        kind.table_blocks(block_size, len(token_ids))
        - kind.skipped_blocks_at(block_size, hit_tokens)
        - len(keys[group])
        + copies[group]
        for group, kind in enumerate(state.group_windows)
    ]
    needed = sum(per_group) + sum(len(group_hits) for group_hits in host_hits)
    held_again = [b for group_hits in hits for b in group_hits if b in state.cached_free_block_ids]
    available = free_blocks(state) - len(held_again)
    if needed > available:
        raise BlockAllocationError.out_of_blocks(request_id, needed, available)
    state = replace(
        state,
        cached_free_block_ids=tuple(
            block_id for block_id in state.cached_free_block_ids if block_id not in held_again
        ),
        ref_counts=add_references(state.ref_counts, tuple(b for h in hits for b in h)),
        counters=replace(
            state.counters, prefix_hit_tokens=state.counters.prefix_hit_tokens + hit_tokens
        ),
        host=hold_in_flight(state.host, {b for h in hits for b in h}),
    )
    for group in groups:
        state, from_host = take_blocks(state, len(host_hits[group]))
        state = copy_in_from_host(state, group, host_hits[group], from_host, keys[group])
        state, taken = take_blocks(state, per_group[group])
        device_hits = iter(hits[group])
        copied_in = dict(zip((i for i, _ in host_hits[group]), from_host, strict=True))
        held = tuple(
            copied_in[index] if index in copied_in else next(device_hits)
            for index in range(len(keys[group]))
        )
        if copies[group]:
            state = _copy_before_write(state, held[-1], taken[0])
            held, taken = (*held[:-1], taken[0]), taken[1:]
        skipped = compute_skipped_blocks(state, group, hit_tokens)
        table = RequestBlockTable(request_id, held + taken, len(token_ids), skipped)
        state = set_table(state, group, table)
    state = replace(state, token_ids=state.token_ids.set(request_id, token_ids))
    if cache_salt is not None:
        state = replace(state, cache_salts=state.cache_salts.set(request_id, cache_salt))
    return cache_full_blocks(state, request_id, first_index=hit_tokens // state.block_size)


def append(
    state: AllocatorState, request_id: str, tokens: int | Sequence[int] = 1
) -> AllocatorState:
    """Grow a request by ``tokens`` (one token by default): a count for a request allocated
    by count, token ids for one allocated by token ids (whose blocks the new ids fill get
    cached), taking blocks as needed.

    Checks: a known request (KeyError); the kind of its allocation (ValueError); the
    count as ``check_token_count`` says, or the ids as ``check_token_ids`` says; enough
    blocks (BlockAllocationError).
    """
    snapshot_request(state, request_id)
    if not is_token_ids(tokens):
        if request_id in state.token_ids:
            tracks_token_ids(request_id, tokens)
        check_token_count(tokens)
        assert isinstance(tokens, int)  # narrowed by check_token_count
        return _grow(state, request_id, tokens)
    if request_id not in state.token_ids:
        allocated_by_count(request_id, len(tokens))
    ids = tuple(tokens)
    check_token_ids(ids)
    state = _grow(state, request_id, len(ids))
    old_ids = state.token_ids[request_id]
    state = replace(state, token_ids=state.token_ids.set(request_id, old_ids + ids))
    return cache_full_blocks(state, request_id, first_index=len(old_ids) // state.block_size)


def _skip_out_of_window(
    state: AllocatorState, request_id: str, computed_tokens: int
) -> AllocatorState:
    """The window rule: in each windowed group, release the table's leading blocks that no
    query at a position at or past ``computed_tokens`` reads, in block index order."""
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        skipped = compute_skipped_blocks(state, group, computed_tokens)
        if skipped <= table.skipped_blocks:
            continue
        dropped = table.block_ids[: skipped - table.skipped_blocks]
        free_before = len(state.free_block_ids)
        # NOTE: not demoted to the host: the skip is part of an append whose refusal is
        # decided first, and it would then depend on the host tier's room too.
        state = release_in_order(state, dropped, demote=False)
        counters = replace(
            state.counters, skipped_blocks=state.counters.skipped_blocks + len(dropped)
        )
        state = replace(
            state,
            counters=counters,
            pending_skipped_block_ids=state.pending_skipped_block_ids
            + state.free_block_ids[free_before:],
        )
        rest = table.block_ids[len(dropped) :]
        state = set_table(state, group, replace(table, block_ids=rest, skipped_blocks=skipped))
    return state


def _grow(state: AllocatorState, request_id: str, token_count: int) -> AllocatorState:
    """Add ``token_count`` tokens to every group's table: skip what left the window first,
    then take each group's blocks (group 0's first), copying a shared partly filled last
    block before the new ones."""
    computed_tokens = snapshot_request(state, request_id).token_count
    state = _skip_out_of_window(state, request_id, computed_tokens)
    block_size = state.block_size
    new_token_count = computed_tokens + token_count
    tracked = request_id in state.token_ids
    writes: list[bool] = []  # the groups whose last block the new tokens write into
    copies: list[bool] = []  # ... and whose write copies it first
    checkpoints: list[bool] = []
    needed: list[int] = []
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        kind = state.group_windows[group]
        cache = state.group_caches[group]
        checkpoints.append(
            token_count > 0
            and tracked
            and kind.is_checkpoint_at(computed_tokens)
            and checkpoint_key(state, request_id, computed_tokens) not in cache
        )
        writes.append(token_count > 0 and kind.rewrites_last_block(block_size, computed_tokens))
        last = table.block_ids[-1] if writes[group] else -1
        copies.append(
            writes[group]
            and kind.copies_before_write(
                shared=state.ref_counts[last] > 1,
                cached=checkpoints[group] or last in cache.values(),
            )
        )
        held = table.skipped_blocks + len(table.block_ids)
        needed.append(kind.table_blocks(block_size, new_token_count) - held + copies[group])
    if sum(needed) > free_blocks(state):
        raise BlockAllocationError.out_of_blocks(request_id, sum(needed), free_blocks(state))
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        if checkpoints[group]:
            state = cache_checkpoint(state, group, request_id, computed_tokens)
        state, taken = take_blocks(state, needed[group])
        block_ids = table.block_ids
        if writes[group] and not copies[group]:
            state = _forget_key(state, group, block_ids[-1])
        if copies[group]:
            state = _copy_before_write(state, block_ids[-1], taken[0])
            block_ids, taken = (*block_ids[:-1], taken[0]), taken[1:]
        grown = replace(table, block_ids=block_ids + taken, token_count=new_token_count)
        state = set_table(state, group, grown)
    return state


def _forget_key(state: AllocatorState, group: int, block_id: int) -> AllocatorState:
    """``state`` with ``block_id`` no longer cached in ``group`` (a ``BlockRemoved``), if it
    was: a write is about to change it."""
    cache = state.group_caches[group]
    if block_id not in cache.values():
        return state
    cache = FrozenMap({key: b for key, b in cache.items() if b != block_id})
    return set_cache(emit(state, BlockRemoved(block_id, group)), group, cache)


def _copy_before_write(state: AllocatorState, source: int, destination: int) -> AllocatorState:
    """The write rule: queue the (``source``, ``destination``) copy and drop the writer's
    reference to ``source`` (held by another table, or cached), which goes where
    ``release`` sends a block once no table holds it."""
    state = replace(
        state,
        pending_copies=(*state.pending_copies, (source, destination)),
        counters=replace(state.counters, cow_copies=state.counters.cow_copies + 1),
    )
    return release_in_order(state, (source,))
