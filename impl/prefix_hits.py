"""A prompt's prefix hit across the KV cache groups: finding it, holding its blocks, copying
the host's back, and caching the blocks a prompt fills.

``PrefixHits.match`` applies the hit rule of ``spec.caching`` to every group's prefix cache
(``impl.prefix_cache``, one per group in the ``BlockPool``) and, with the host prefix
cache, to the host tier's: the longest hit every group allows, each group's kind saying
which part of its cached blocks a hit holds (``hit_part``: a sliding window needs only the
blocks its window reads, a state group a checkpoint at exactly the hit). The
admission (``KVCacheManager.allocate``) checks the blocks it needs, then holds the device
hits (``hold_hits``), takes a device block for each host hit with its copy in
(``held_blocks``), copies a hit's last block where its kind's write rule says so
(a state group's checkpoint) and caches what the prompt fills (``cache_full_blocks``). It
never checks arguments: the front has done that.
"""

from impl.groups import KVCacheGroups
from impl.prefix_cache import BlockHash, BlockKey, default_block_hash
from impl.tables import Table
from spec import BlockAllocationError
from spec.kinds import copies_hit


class PrefixHits:
    """The prefix-cache operations of a prompt over a pool's groups (``cache_groups``: their
    kinds, the pool's caches and the host tier's)."""

    __slots__ = ("block_hash", "block_size", "cache_groups", "groups", "host", "pool")

    def __init__(self, cache_groups: KVCacheGroups, block_hash: BlockHash) -> None:
        self.cache_groups = cache_groups
        self.block_size = cache_groups.block_size
        self.groups = cache_groups.groups
        self.pool = cache_groups.pool
        self.host = cache_groups.host
        self.block_hash = block_hash

    def allocate(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None
    ) -> tuple[Table, int]:
        """A new table of ``token_ids`` holding the longest prefix cached under
        ``cache_salt`` and fresh blocks past it, and how many tokens hit; its skips and its
        cached blocks are the caller's. Refused (``BlockAllocationError``) when the queues,
        less the cached free blocks the hit holds again, hold fewer blocks than the blocks
        past the hit, the host hits and the copies of the write rule need; every block is
        hashed before anything changes, so a hash that raises changes nothing either."""
        block_size = self.block_size
        pool = self.pool
        cached_tokens, group_hits, group_host_hits, keys = self.match(token_ids, cache_salt)
        tokens = len(token_ids)
        per_group: list[int] = []  # each group's blocks past the hit, and its copy's
        copies: list[int] = []  # the groups whose hit's last block is copied (``spec.growth``)
        for group, kind in enumerate(self.groups):
            hit = len(group_hits[group]) + len(group_host_hits[group])
            # The blocks born skipped are those before the hit's part (``hit_part``'s first).
            skipped = kind.skip_target(block_size, cached_tokens)
            count = kind.table_blocks(block_size, tokens) - skipped - hit
            if hit and copies_hit(kind.spec, block_size, cached_tokens):
                copies.append(group)
                count += 1
            per_group.append(count)
        needed = sum(per_group) + sum(map(len, group_host_hits))
        cached_free = pool.cached_free  # an in-flight hit is unreferenced but not free
        held_again = sum(1 for hits in group_hits for b in hits if b in cached_free)
        available = pool.free_blocks - held_again
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        pool.caches[0].extend_keys(token_ids, keys, block_size, cache_salt)
        self.hold_hits(group_hits)
        if any(group_host_hits) or copies:
            held = self.held_blocks(
                cached_tokens, group_hits, group_host_hits, keys, per_group, copies=copies
            )
        else:
            held = [
                hits + pool.take(per_group[group], group) for group, hits in enumerate(group_hits)
            ]
        table = Table(
            held,
            len(token_ids),
            list(token_ids),
            keys,
            cache_salt=cache_salt,
            slotless_groups=self.cache_groups.slotless_groups,
        )
        return table, cached_tokens

    def hold_hits(self, group_hits: list[list[int]]) -> None:
        """Each group's device hits gain a reference (a cached free block leaves its queue,
        an in-flight one stops being in flight)."""
        for group, hits in enumerate(group_hits):
            self.host.hold_again(self.pool.hold(hits, group))

    def take_host_hits(
        self, group: int, host_hits: list[tuple[int, int]], keys: list[BlockKey]
    ) -> list[int]:
        """A prefix hit on blocks ``group`` caches on the host only, (block index, host
        block) each: take a device block for each, cache it on the device under its key
        and queue the copy in. Returns the device blocks, in order."""
        device_ids = self.pool.take(len(host_hits), group)
        cache = self.pool.caches[group]
        for (index, _), device_id in zip(host_hits, device_ids, strict=True):
            cache.insert(keys[index], device_id)
        self.host.copy_hits_in([host_id for _, host_id in host_hits], device_ids)
        return device_ids

    def held_blocks(
        self,
        cached_tokens: int,
        group_hits: list[list[int]],
        group_host_hits: list[list[tuple[int, int]]],
        keys: list[BlockKey],
        per_group: list[int],
        *,
        copies: list[int],
    ) -> list[list[int]]:
        """Each group's blocks of a prompt whose hit is partly on the host only or copied
        by its kind's write rule, group by group: the host hits take their device blocks
        (``take_host_hits``), then the blocks past the hit are taken, held in block index
        order with the device hits (held already); then, in ``copies``, the hit's last
        block is copied into the first of them (``KVCacheGroups.copy_before_write``)."""
        held: list[list[int]] = []
        block_size = self.block_size
        for group, (hits, host_hits) in enumerate(zip(group_hits, group_host_hits, strict=True)):
            copied_in = self.take_host_hits(group, host_hits, keys) if host_hits else []
            by_index = dict(zip((index for index, _ in host_hits), copied_in, strict=True))
            first = cached_tokens // block_size - len(hits) - len(host_hits)
            device_hits = iter(hits)
            row = [
                by_index[index] if index in by_index else next(device_hits)
                for index in range(first, first + len(hits) + len(host_hits))
            ]
            taken = self.pool.take(per_group[group], group)
            if group in copies:
                self.cache_groups.copy_before_write(row, taken.pop(0), group)
            held.append(row + taken)
        return held

    def match(
        self, token_ids: tuple[int, ...], cache_salt: str | None
    ) -> tuple[int, list[list[int]], list[list[tuple[int, int]]], list[BlockKey]]:
        """The hit rule of ``spec.allocator`` under ``cache_salt``: the cached tokens, each
        group's hit blocks on the device (those not born skipped), each group's hits on the
        host only ((block index, host block), with the host prefix cache) and the keys
        made (one per block hashed).

        Hashes every full block before the last token, but stops at the first block a full
        group misses (no hit can pass it); O(blocks x groups), as vLLM's hybrid hit search.
        """
        block_size = self.block_size
        caches = self.pool.caches
        groups = self.groups
        block_hash = self.block_hash
        # NOTE: the default hash is inlined: a Python call per block is a sixth of a hit.
        inline_hash = block_hash is default_block_hash
        hit_limit = (len(token_ids) - 1) // block_size
        keys: list[BlockKey] = []
        # found[g][i]: group g's cached block for block index i, or None.
        found: list[list[int | None]] = [[] for _ in caches]
        # host_found[g][i]: the host block caching block index i where group g's device
        # cache misses it (the host prefix cache; none without one).
        host_caches = self.host.caches
        host_found: list[dict[int, int]] = [{} for _ in caches]
        parent: BlockKey | None = None
        parent_hash = caches[0].root_hash(cache_salt)
        longest = hit_limit
        # A miss in a group whose hit needs every block ends the search (full attention).
        reads_all = [group.needs_every_block for group in groups]
        for index in range(hit_limit):
            chunk = token_ids[index * block_size : (index + 1) * block_size]
            if inline_hash:
                hash_value = hash((parent_hash, chunk))
            else:
                hash_value = block_hash(parent_hash, chunk)
            key: BlockKey | None = None
            missed = False
            for group, cache in enumerate(caches):
                block_id = cache.lookup(parent, chunk, hash_value, cache_salt)
                found[group].append(block_id)
                if block_id is None and host_caches:
                    host_cache = host_caches[group]
                    host_id = host_cache.lookup(parent, chunk, hash_value, cache_salt)
                    if host_id is not None:
                        host_found[group][index] = host_id
                        key = key or host_cache.block_keys[host_id]
                        continue
                if block_id is None:
                    missed = missed or reads_all[group]
                elif key is None:
                    # The cached key object itself, so later lookups meet the very parent.
                    key = cache.block_keys[block_id]
            keys.append(BlockKey(parent, chunk, hash_value, cache_salt) if key is None else key)
            if missed:
                longest = index
                break
            parent, parent_hash = keys[-1], hash_value
        runs = [
            _hit_runs([b if b is not None else on_host.get(i) for i, b in enumerate(group_found)])
            for group_found, on_host in zip(found, host_found, strict=True)
        ]
        for hit_blocks in range(longest, 0, -1):
            parts = [
                group.hit_part(block_size, group_found, on_host, run, hit_blocks)
                for group, group_found, on_host, run in zip(
                    groups, found, host_found, runs, strict=True
                )
            ]
            if None not in parts:
                return (
                    hit_blocks * block_size,
                    [part[0] for part in parts if part is not None],
                    [part[1] for part in parts if part is not None],
                    keys,
                )
        return 0, [[] for _ in caches], [[] for _ in caches], keys

    def cache_full_blocks(self, table: Table, first_index: int) -> None:
        """Cache every full block from ``first_index`` on, in every group, unless that
        group caches its prefix already. The caller has keyed every full block: it hashes
        before anything changes, so a hash that raises changes nothing."""
        assert table.token_ids is not None and table.keys is not None, "only token tables cache"
        keys = table.keys
        full_blocks = len(table.token_ids) // self.block_size
        assert len(keys) >= full_blocks, "every full block is keyed before it is cached"
        block_size = self.block_size
        token_count = len(table.token_ids)
        for kind, cache, held, skipped in zip(
            self.groups, self.pool.caches, table.group_block_ids, table.skipped_blocks, strict=True
        ):
            # An attention group's full blocks; none in a state group (it caches checkpoints).
            for index in kind.spec.keyed_block_indices(
                block_size, first_index, skipped, token_count
            ):
                cache.insert(keys[index], held[index - skipped])


def _hit_runs(found: list[int | None]) -> list[int]:
    """For each block index, how many consecutive indices up to it are cached."""
    runs: list[int] = []
    run = 0
    for block_id in found:
        run = 0 if block_id is None else run + 1
        runs.append(run)
    return runs
