"""The prefix cache: which cached blocks a prompt reuses, what a request caches, and reset.

Sharing by prefix. A full block whose tokens are a prefix that two prompts share may sit
in several tables. The prefix cache of each KV cache group maps a ``CacheKey`` (a cache
salt and a prompt prefix that ends on a block boundary) to the block holding its last
``block_size`` tokens. Keys are whole prefixes, so a hit is confirmed by comparing token
ids, never a hash.

Cache salts (tenants). A request allocated by token ids may name a ``cache_salt``
(``None``: no salt, a namespace of its own); it finds hits only among blocks cached under
its own salt, and caches the blocks it fills under it.

- The hit rule. A prompt hit of h tokens (a multiple of block_size, at most
  len(prompt) - 1) needs, in every full group, the cached blocks of all of [0, h), and
  in a group with window W only those covering [max(0, h - W + 1), h): the window rule
  at L0 = h skips the blocks before, so they are born skipped. ``allocate`` takes the
  largest such h (vLLM's ``find_longest_cache_hit``: a sliding-window group needs
  ceil((W - 1) / block_size) contiguous cached blocks ending at the hit), and in a state
  group a checkpoint cached on the device under exactly the hit's prefix (``spec.kinds``;
  vLLM's ``HybridKVCacheCoordinator`` finds the same h as a fixed point). With the host
  prefix cache a key cached on the host only counts too: the hit takes a device block
  for it and copies it back (``copy_in_from_host``).
- What is cached. Every full block of a request allocated by token ids, in every
  attention group, block index order, under its salt, unless that group caches the key
  already (``cache_full_blocks``); in a state group, the checkpoints of ``spec.kinds``.

KV cache events (``spec.events``). Every change to a group's prefix cache appends an event
to ``events``, in the order the caches changed, until ``take_events`` drains them:
- a key enters a cache only where a full block is cached (``allocate`` and ``append`` of
  token ids, a host hit's block): ``BlockStored``; a key some block of the group caches
  already is refused and emits nothing;
- a key leaves a cache when a cached free block is taken for new tokens (its eviction, in
  the order taken, before the blocks the same call caches), and when ``truncate`` leaves
  a cached block partly filled: ``BlockRemoved`` (of the group whose cache held it);
- ``reset_prefix_cache`` drops every key: one ``AllBlocksCleared``, even of empty caches.
Nothing else touches a cache: a block a hit holds again, a released one and a forked one
keep their keys, and a refused operation emits nothing.
"""

from dataclasses import replace

from spec.blocks import with_host
from spec.events import AllBlocksCleared, BlockStored, CachedBlock
from spec.frozen_map import FrozenMap
from spec.host_tier import release_host_blocks
from spec.records import CacheKey
from spec.state import (
    AllocatorState,
    TokenIds,
    emit,
    get_cache_salt,
    set_cache,
)


def is_hit_cached(
    state: AllocatorState,
    group: int,
    token_ids: TokenIds,
    hit_tokens: int,
    cache_salt: str | None = None,
) -> bool:
    """Whether ``group`` caches, under ``cache_salt``, every key a hit of ``hit_tokens``
    tokens needs there (on the device or the host: ``is_key_cached``): its kind's
    ``hit_keys``, an attention group's full blocks from the first a query past the hit
    reads, a state group's checkpoint of exactly ``hit_tokens`` (never on the host: a
    state group has no host tier)."""
    kind = state.group_windows[group]
    keys = kind.hit_keys(state.block_size, token_ids, hit_tokens, cache_salt)
    return all(is_key_cached(state, group, key) for key in keys)


def is_key_cached(state: AllocatorState, group: int, key: CacheKey) -> bool:
    """Whether ``group`` caches ``key`` on the device or, with the host prefix cache, on
    the host (a demoted prefix a hit brings back)."""
    if key in state.group_caches[group]:
        return True
    return state.host.host_prefix_cache and key in state.host.host_caches[group]


def cached_prefix_tokens(
    state: AllocatorState, token_ids: TokenIds, cache_salt: str | None = None
) -> int:
    """The hit rule: the largest multiple h of block_size, at most len(token_ids) - 1, that
    every group caches under ``cache_salt`` (``is_hit_cached``); 0 if none. The last token
    is never a hit, so that at least one token of a prompt is computed."""
    block_size = state.block_size
    longest = (len(token_ids) - 1) // block_size * block_size
    for hit_tokens in range(longest, 0, -block_size):
        groups = range(len(state.group_windows))
        if all(is_hit_cached(state, g, token_ids, hit_tokens, cache_salt) for g in groups):
            return hit_tokens
    return 0


def hit_keys(
    state: AllocatorState, token_ids: TokenIds, group: int, cache_salt: str | None
) -> list[CacheKey]:
    """The keys of the blocks a hit needs in ``group``, in index order (those not born
    skipped); in a state group, its checkpoint's (none for no hit)."""
    hit_tokens = cached_prefix_tokens(state, token_ids, cache_salt)
    kind = state.group_windows[group]
    return list(kind.hit_keys(state.block_size, token_ids, hit_tokens, cache_salt))


def cached_prefix_blocks(
    state: AllocatorState, token_ids: TokenIds, group: int = 0, cache_salt: str | None = None
) -> tuple[int, ...]:
    """The cached device blocks a prompt of ``token_ids`` under ``cache_salt`` would reuse
    in ``group``: those of the hit of ``cached_prefix_tokens`` tokens that are not born
    skipped and are cached on the device, in index order."""
    cache = state.group_caches[group]
    return tuple(
        cache[key] for key in hit_keys(state, token_ids, group, cache_salt) if key in cache
    )


def host_prefix_hits(
    state: AllocatorState, token_ids: TokenIds, group: int = 0, cache_salt: str | None = None
) -> tuple[tuple[int, int], ...]:
    """The blocks of that hit that ``group`` caches on the host only: (index among the
    hit's blocks, host block), in index order. Each takes a device block and a
    (host -> device) copy."""
    cache = state.group_caches[group]
    host_cache = state.host.host_caches[group] if state.host.host_caches else FrozenMap()
    return tuple(
        (index, host_cache[key])
        for index, key in enumerate(hit_keys(state, token_ids, group, cache_salt))
        if key not in cache
    )


def get_cached_blocks(state: AllocatorState) -> frozenset[CachedBlock]:
    """Every (group, block id, key) the caches hold: what replaying every event emitted so
    far gives (``spec.events.replay_events``)."""
    return frozenset(
        CachedBlock(group, block_id, key)
        for group, cache in enumerate(state.group_caches)
        for key, block_id in cache.items()
    )


def cache_full_blocks(state: AllocatorState, request_id: str, first_index: int) -> AllocatorState:
    """In each group, cache each block its kind keys from ``first_index`` on (an
    attention group's full blocks) under the request's salt, unless that group caches
    that key already; each one cached emits ``BlockStored`` (its parent: the block the group caches
    the prefix before it in)."""
    token_ids = state.token_ids[request_id]
    cache_salt = get_cache_salt(state, request_id)
    block_size = state.block_size
    for group, tables in enumerate(state.group_tables):
        table = tables[request_id]
        cache = state.group_caches[group]
        kind = state.group_windows[group]
        indices = kind.keyed_block_indices(
            block_size, first_index, table.skipped_blocks, len(token_ids)
        )
        for index in indices:
            prefix = CacheKey(cache_salt, token_ids[: (index + 1) * block_size])
            if prefix in cache:
                continue
            block_id = table.block_ids[index - table.skipped_blocks]
            cache = cache.set(prefix, block_id)
            state = emit(state, _stored(cache, block_id, group, prefix, block_size))
        state = set_cache(state, group, cache)
    return state


def checkpoint_key(state: AllocatorState, request_id: str, computed_tokens: int) -> CacheKey:
    """The key a state group caches the checkpoint of ``request_id`` at ``computed_tokens``
    under: its salt and its first ``computed_tokens`` token ids."""
    return CacheKey(
        get_cache_salt(state, request_id), state.token_ids[request_id][:computed_tokens]
    )


def cache_checkpoint(
    state: AllocatorState, group: int, request_id: str, computed_tokens: int
) -> AllocatorState:
    """The checkpoint rule of ``spec.kinds``: cache the running block of ``request_id`` in
    state group ``group`` under its salt and its first ``computed_tokens`` token ids,
    unless a block is cached under that key already (then nothing, and no event)."""
    key = checkpoint_key(state, request_id, computed_tokens)
    cache = state.group_caches[group]
    if key in cache:
        return state
    block_id = state.group_tables[group][request_id].block_ids[0]
    cache = cache.set(key, block_id)
    state = emit(state, _stored(cache, block_id, group, key, state.block_size))
    return set_cache(state, group, cache)


def copy_in_from_host(
    state: AllocatorState,
    group: int,
    host_hits: tuple[tuple[int, int], ...],
    device_ids: tuple[int, ...],
    keys: list[CacheKey],
) -> AllocatorState:
    """A prefix hit on keys ``group`` caches on the host only: each gets its device block
    (``device_ids``, in order), cached on the device again (a ``BlockStored`` each, in
    index order), with a (host -> device) copy; their host blocks become the most recently
    used, the chain's head last, so the host evicts a chain's tail before its head (as a
    release demotes it)."""
    if not host_hits:
        return state
    cache = state.group_caches[group]
    for (index, _), device_id in zip(host_hits, device_ids, strict=True):
        key = keys[index]
        cache = cache.set(key, device_id)
        state = emit(state, _stored(cache, device_id, group, key, state.block_size))
    used = {host_id for _, host_id in host_hits}
    host = state.host
    host = replace(
        host,
        pending_host_to_device=host.pending_host_to_device
        + tuple((h, d) for (_, h), d in zip(host_hits, device_ids, strict=True)),
        host_cached_block_ids=tuple(h for h in host.host_cached_block_ids if h not in used)
        + tuple(h for _, h in reversed(host_hits)),
        counters=replace(
            host.counters, host_hit_blocks=host.counters.host_hit_blocks + len(host_hits)
        ),
    )
    return set_cache(replace(state, host=host), group, cache)


def _stored(
    cache: FrozenMap[CacheKey, int], block_id: int, group: int, key: CacheKey, block_size: int
) -> BlockStored:
    """The ``BlockStored`` of ``block_id`` cached under ``key`` in ``cache``: its parent is
    the block the cache holds the prefix before it in; with none, the whole prefix."""
    before = key.token_ids[:-block_size]
    parent = cache.get(CacheKey(key.cache_salt, before)) if before else None
    added = key.token_ids[-block_size:] if parent is not None else key.token_ids
    return BlockStored(block_id, group, parent, added, key.cache_salt)


def reset_prefix_cache(state: AllocatorState) -> AllocatorState:
    """Forget every cached prefix, in every group: the cached free blocks join the tail of
    the free queue as plain free blocks (least recently freed first, their queue order),
    and the blocks tables hold keep their K/V but lose their keys, so no later prompt hits
    them. Blocks the tables fill later are cached again as usual. Never refused; emits one
    ``AllBlocksCleared``.

    The host prefix cache forgets its keys too: its blocks join the host free queue's
    tail in their order (least recently used first), but one a pending copy in reads,
    which waits for ``take_transfers``; a copy out into one is dropped and its device
    block joins the free queue, uncached."""
    state = replace(
        state,
        free_block_ids=state.free_block_ids + state.cached_free_block_ids,
        cached_free_block_ids=(),
        group_caches=tuple(FrozenMap[CacheKey, int]() for _ in state.group_caches),
    )
    state = emit(state, AllBlocksCleared())
    host = state.host
    if not host.host_cached_block_ids:
        return state
    copying_in = {h for h, _ in host.pending_host_to_device}
    host = release_host_blocks(
        replace(
            host,
            host_caches=tuple(FrozenMap[CacheKey, int]() for _ in host.host_caches),
            host_cached_block_ids=(),
        ),
        (h for h in host.host_cached_block_ids if h not in copying_in),
    )
    return with_host(state, host)
