"""The spec-side model of a target: its observation as a spec ``AllocatorState``.

The kit renames the target's block ids through a bijection onto the spec's 0..N-1 (its
pool ids in ascending order, so a target that lends 0..N-1 keeps its ids and can be
compared exactly), and remembers what each block holds: the tokens of the prefix it ends
and the cache salt it was filled under, learned from the tables while the block sat full
in one. A block the target can find by a
prefix hit becomes a spec cache entry keyed by that prefix. With the state in hand, every
rule of the spec applies to the target as it is: ``spec.invariants`` and the operations of
``spec.api`` on it say what must hold and what the next step must give.

Not here: which properties are checked (``harness.conformance.properties``).
"""

from collections.abc import Iterable, Mapping, Sequence

import spec
from harness.conformance.adapter import Observation, TargetTable

TokenIds = tuple[int, ...]


class Bijection:
    """Target block ids <-> spec block ids: the pool's ids in ascending order map to 0..N-1.
    An id outside the pool maps past N, so the state it lands in breaks ``partition``."""

    def __init__(self, pool_block_ids: Iterable[int]) -> None:
        ordered = sorted(set(pool_block_ids))
        self.to_spec: dict[int, int] = {block_id: index for index, block_id in enumerate(ordered)}
        self.to_target: dict[int, int] = dict(enumerate(ordered))
        # The pool's size, fixed: a stray id must not enlarge the pool it is checked against.
        self.total_blocks = len(ordered)

    def spec_id(self, block_id: int) -> int:
        found = self.to_spec.get(block_id)
        if found is None:
            found = len(self.to_spec)
            self.to_spec[block_id] = found
            self.to_target[found] = block_id
        return found

    def spec_ids(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        return tuple(self.spec_id(block_id) for block_id in block_ids)

    def target_ids(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        return tuple(self.to_target[block_id] for block_id in block_ids)


class Contents:
    """What each target block holds, per KV cache group: the key of the prefix its last
    token ends (the salt of the table it sat full in, and the prefix). In a recurrent state
    group (``state_groups``), the key of the tokens its request had when the block was its
    running state with a length on the block grid: the state it holds, learned from the
    tokens, not from where the target puts the block."""

    def __init__(self, groups: int, state_groups: frozenset[int] = frozenset()) -> None:
        self.keys: list[dict[int, spec.CacheKey]] = [{} for _ in range(groups)]
        self.state_groups = state_groups

    def learn(
        self,
        observation: Observation,
        token_ids: Mapping[str, TokenIds],
        block_size: int,
        cache_salts: Mapping[str, str] | None = None,
    ) -> None:
        """Record the key of every full block in a table whose tokens the kit knows, under
        the salt of that table's request (``cache_salts``; none if absent); a block in a
        table tracked by count holds nothing findable, nor one not yet full, unless it is
        the block of a key whose first tokens the table still has (a rollback cut into it:
        its K/V is the key's until a write, ``spec.releasing.truncate``). A state group's
        running block holds the state after its request's tokens when their count is a
        positive multiple of ``block_size``, and nothing findable otherwise."""
        salts = cache_salts or {}
        for group, tables in enumerate(observation.tables):
            keys = self.keys[group]
            for request_id, table in tables.items():
                ids = token_ids.get(request_id)
                salt = salts.get(request_id)
                for index, block_id in enumerate(table.block_ids, start=table.skipped_blocks):
                    end = (index + 1) * block_size
                    if group in self.state_groups:
                        end = table.token_count if table.token_count % block_size == 0 else -1
                    if ids is not None and 0 < end <= len(ids):
                        keys[block_id] = spec.CacheKey(salt, ids[:end])
                    elif not _is_cut_into(keys.get(block_id), ids, salt, end):
                        keys.pop(block_id, None)
                    for other in self.keys:
                        if other is not keys:
                            other.pop(block_id, None)

    def key(self, group: int, block_id: int) -> spec.CacheKey | None:
        return self.keys[group].get(block_id)

    def held_keys(self, group: int) -> set[spec.CacheKey]:
        """The keys some block of ``group`` still holds (not yet taken for other tokens)."""
        return set(self.keys[group].values())


def _is_cut_into(
    key: spec.CacheKey | None, token_ids: TokenIds | None, salt: str | None, end: int
) -> bool:
    """Whether a table with ``token_ids`` ending before ``end`` (its block's last token)
    holds a block that still holds ``key``: the key ends there, under the table's salt,
    and begins with the tokens the table has in it."""
    return (
        key is not None
        and token_ids is not None
        and key.cache_salt == salt
        and len(key.token_ids) == end
        and key.token_ids[: len(token_ids)] == tuple(token_ids)
    )


def to_state(
    observation: Observation,
    *,
    block_size: int,
    group_windows: Sequence[spec.GroupKind],
    bijection: Bijection,
    contents: Contents,
    token_ids: Mapping[str, TokenIds],
    cache_salts: Mapping[str, str] | None = None,
) -> spec.AllocatorState:
    """The spec state the target is in, in spec ids. Without the target's ref counts, each
    block counts its holders (so ``ref_counts`` then checks nothing); a cached block whose
    content the kit never saw gets an impossible key, which breaks ``cache_sound``. A second
    cached block for a prefix (``duplicate_cached_blocks``) is left out of the cache, and
    counted free if it is free: a hit finds the prefix in one block. ``cache_salts`` are
    the salts of the live requests that have one."""
    group_tables = tuple(
        spec.FrozenMap(
            {
                request_id: _spec_table(request_id, table, bijection)
                for request_id, table in tables.items()
            }
        )
        for tables in observation.tables
    )
    if observation.ref_counts is None:
        holders: dict[int, int] = {}
        for tables in group_tables:
            for table in tables.values():
                for block_id in table.block_ids:
                    holders[block_id] = holders.get(block_id, 0) + 1
        ref_counts = spec.FrozenMap(holders)
    else:
        ref_counts = spec.FrozenMap(
            {bijection.spec_id(b): n for b, n in observation.ref_counts.items() if n}
        )
    caches = []
    duplicates = set(duplicate_cached_blocks(observation, contents))
    for group in range(len(group_windows)):
        cached = observation.cached_block_ids[group] if observation.cached_block_ids else ()
        cache: dict[spec.CacheKey, int] = {}
        for block_id in sorted(set(cached) - duplicates):
            key = contents.key(group, block_id) or spec.CacheKey(None, ())
            cache[key] = bijection.spec_id(block_id)
        caches.append(spec.FrozenMap(cache))
    # A second cached block for a prefix cannot be a spec cache entry; free, it is free.
    cached_free = [b for b in observation.cached_free_block_ids if b not in duplicates]
    free = [*observation.free_block_ids]
    free += [b for b in observation.cached_free_block_ids if b in duplicates]
    requests = observation.tables[0].keys() if observation.tables else ()
    return spec.AllocatorState(
        block_size=block_size,
        total_blocks=bijection.total_blocks,
        free_block_ids=bijection.spec_ids(free),
        group_tables=group_tables,
        cached_free_block_ids=bijection.spec_ids(cached_free),
        ref_counts=ref_counts,
        token_ids=spec.FrozenMap({r: ids for r, ids in token_ids.items() if r in requests}),
        group_caches=tuple(caches),
        pending_copies=tuple(
            (bijection.spec_id(source), bijection.spec_id(destination))
            for source, destination in observation.pending_copies
        ),
        counters=spec.SharingCounters(),
        group_windows=tuple(group_windows),
        host=spec.HostTier(in_flight_block_ids=bijection.spec_ids(observation.in_flight_block_ids)),
        cache_salts=spec.FrozenMap(
            {r: salt for r, salt in (cache_salts or {}).items() if r in requests}
        ),
    )


def duplicate_cached_blocks(observation: Observation, contents: Contents) -> list[int]:
    """Cached blocks whose key (salt and prefix) an earlier block (by id) of the same group
    caches too."""
    duplicates = []
    for group, cached in enumerate(observation.cached_block_ids):
        seen: set[spec.CacheKey] = set()
        for block_id in sorted(cached):
            key = contents.key(group, block_id)
            if key is None:
                continue
            if key in seen:
                duplicates.append(block_id)
            seen.add(key)
    return duplicates


def _spec_table(
    request_id: str, table: TargetTable, bijection: Bijection
) -> spec.RequestBlockTable:
    return spec.RequestBlockTable(
        request_id, bijection.spec_ids(table.block_ids), table.token_count, table.skipped_blocks
    )
