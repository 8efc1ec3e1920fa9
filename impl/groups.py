"""The KV cache groups of a pool: their two kinds, and every table operation across them.

A group is full attention (``FullAttentionGroup``: it keeps every block of a table) or a
sliding window (``SlidingWindowGroup``: it releases a table's leading blocks once no
query reads them, the window rule of ``spec.allocator``). ``KVCacheGroups`` applies an
operation to a request's table in every group, group 0 first, with one code path and a
fast case for the tokens that land in every group's own last block: growing a table,
finding a prompt's cache hit, caching the blocks a prompt fills.

It takes and releases blocks through the ``BlockPool`` and never checks arguments: the
front (``impl.manager``) has done that before it calls in.
"""

from typing import ClassVar

from impl.block_pool import BlockPool
from impl.prefix_cache import BlockHash, BlockKey, PrefixCache, default_block_hash
from impl.tables import NEVER, Table
from spec import (
    BlockAllocationError,
    ReleasedBlocks,
    blocks_for_tokens,
    skipped_blocks_at,
    slot_index,
)
from spec.rules import next_skip_token_count

# A token count no request reaches: the next skip of a table with no windowed group.


class FullAttentionGroup:
    """A group of full-attention layers: every query reads every key, nothing is skipped."""

    __slots__ = ("cache", "window")

    def __init__(self, cache: PrefixCache, window: int | None = None) -> None:
        self.cache = cache
        self.window = window

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        """``spec.compute_skipped_blocks``: the leading blocks of a table no query at or past
        ``computed_tokens`` reads."""
        return 0

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        """The least computed length at which a table skipping ``skipped_blocks`` skips more."""
        return NEVER


class SlidingWindowGroup(FullAttentionGroup):
    """A group of layers with a sliding window of ``window`` tokens."""

    __slots__ = ()

    def skip_target(self, block_size: int, computed_tokens: int) -> int:
        return skipped_blocks_at(block_size, computed_tokens, self.window)

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int:
        skip_at = next_skip_token_count(block_size, skipped_blocks, self.window)
        assert skip_at is not None, "a sliding window has a width"
        return skip_at


class KVCacheGroups:
    """The pool's groups, in order, and the operations that touch a table in each.

    ``group_windows[g]`` names group g's kind (``None``: full attention) and ``pool.caches[g]``
    is its prefix cache.
    """

    __slots__ = ("block_hash", "block_size", "caches", "groups", "pool")

    # The kinds a subclass may swap for its own (the planted bugs of the tests do).
    full_attention_group: ClassVar[type[FullAttentionGroup]] = FullAttentionGroup
    sliding_window_group: ClassVar[type[SlidingWindowGroup]] = SlidingWindowGroup

    def __init__(
        self,
        block_size: int,
        group_windows: tuple[int | None, ...],
        pool: BlockPool,
        block_hash: BlockHash,
    ) -> None:
        self.block_size = block_size
        self.caches = pool.caches
        self.groups = [
            self.full_attention_group(cache)
            if window is None
            else self.sliding_window_group(cache, window)
            for window, cache in zip(group_windows, self.caches, strict=True)
        ]
        self.pool = pool
        self.block_hash = block_hash

    def set_skipped(self, table: Table, computed_tokens: int) -> None:
        """Give ``table`` the skips of a request whose first ``computed_tokens`` tokens are
        computed (a prompt's hit: the blocks before it are born skipped)."""
        block_size = self.block_size
        table.skipped_blocks = [
            group.skip_target(block_size, computed_tokens) for group in self.groups
        ]
        self.set_next_skip(table)

    def set_next_skip(self, table: Table) -> None:
        """``table.next_skip_at``: the least length at which some group skips a block more."""
        block_size = self.block_size
        table.next_skip_at = min(
            group.next_skip_at(block_size, skipped)
            for group, skipped in zip(self.groups, table.skipped_blocks, strict=True)
        )

    def grow(self, request_id: str, table: Table, token_count: int) -> None:
        """Add ``token_count`` tokens to every group's table: the window rule first (what each
        windowed group skips at L0 = the tokens before), then each group's new blocks, group
        0's first, copying a shared partly filled last block before the new ones.

        Atomic: the blocks the skips would free count as available, and nothing changes
        until the check has passed.
        """
        block_size = self.block_size
        position = table.token_count
        ref_counts = self.pool.ref_counts
        counters = self.pool.counters
        if 0 < token_count <= -position % block_size and position < table.next_skip_at:
            # NOTE: the tokens land in every group's last block and no window slides: unless
            # a last block is shared (a copy), nothing but counts changes. Measured in CPU
            # time: 3.8 -> 0.9 us a decode append with two full groups (one group: 0.28 us).
            for held in table.group_block_ids:
                if ref_counts[held[-1]] > 1:
                    break
            else:
                table.token_count = position + token_count
                counters.allocated_tokens += token_count
                return
        # NOTE: ``blocks_for_tokens`` inlined (its checks are the front's): a call is a
        # tenth of opening a block.
        blocks = -(-(position + token_count) // block_size)
        group_block_ids = table.group_block_ids
        if len(group_block_ids) == 1 and position < table.next_skip_at:
            held = group_block_ids[0]
            if position % block_size == 0 or ref_counts[held[-1]] == 1:
                one_missing = blocks - table.skipped_blocks[0] - len(held)
                available = self.pool.free_blocks
                if one_missing > available:
                    raise BlockAllocationError.out_of_blocks(request_id, one_missing, available)
                held.extend(self.pool.take(one_missing, 0))
                table.token_count = position + token_count
                counters.allocated_tokens += token_count
                return
        if position < table.next_skip_at and (
            position % block_size == 0
            or all(ref_counts[held[-1]] == 1 for held in table.group_block_ids)
        ):
            # NOTE: no window slides and no last block is shared (a decode token opening a
            # block): each group takes its missing blocks, nothing else. Measured: the
            # general path below made a one-group decode append 60% slower on average.
            missing = [
                blocks - skipped - len(held)
                for held, skipped in zip(table.group_block_ids, table.skipped_blocks, strict=True)
            ]
            available = self.pool.free_blocks
            if sum(missing) > available:
                raise BlockAllocationError.out_of_blocks(request_id, sum(missing), available)
            for group, held in enumerate(table.group_block_ids):
                held.extend(self.pool.take(missing[group], group))
            table.token_count = position + token_count
            counters.allocated_tokens += token_count
            return
        drops: list[int] = []
        copies: list[bool] = []
        needed: list[int] = []
        freed_by_skips = 0
        host = self.pool.host
        # A skipped block a pending copy between the tiers touches goes in flight: not free.
        busy: set[int] = set()
        if host.copying_out or host.copying_in:
            busy = host.copying_out.keys() | host.copying_in.keys()
        for kind, held, skipped in zip(
            self.groups, table.group_block_ids, table.skipped_blocks, strict=True
        ):
            drop = max(kind.skip_target(block_size, position) - skipped, 0)
            # O(drop): each block of a table is skipped once, so O(1) amortised per token.
            freed_by_skips += sum(
                1 for block_id in held[:drop] if ref_counts[block_id] == 1 and block_id not in busy
            )
            copy_on_write = (
                token_count > 0 and position % block_size != 0 and ref_counts[held[-1]] > 1
            )
            drops.append(drop)
            copies.append(copy_on_write)
            needed.append(blocks - skipped - len(held) + copy_on_write)
        available = self.pool.free_blocks + freed_by_skips
        if sum(needed) > available:
            raise BlockAllocationError.out_of_blocks(request_id, sum(needed), available)
        for group, drop in enumerate(drops):
            if drop:
                self.skip(table, group, drop)
        for group, held in enumerate(table.group_block_ids):
            taken = self.pool.take(needed[group], group)
            if copies[group]:
                self.pool.copy_last_block(held, taken.pop(0))
            held.extend(taken)
        table.token_count = position + token_count
        counters.allocated_tokens += token_count

    def skip(self, table: Table, group: int, drop: int) -> None:
        """Release the first ``drop`` blocks ``table`` holds in ``group``, in block index
        order; those that became free and uncached wait for ``take_skipped_blocks``."""
        held = table.group_block_ids[group]
        self.pool.skip(held[:drop], group)
        # NOTE: ``del`` at the front moves the rest of the list (a C memmove), and a windowed
        # table holds about (W + tokens added at once) / block_size blocks whatever the
        # request's length, so this stays bounded by the window, not the request.
        del held[:drop]
        table.skipped_blocks[group] += drop
        self.set_next_skip(table)
        self.pool.counters.skipped_blocks += drop

    def release(self, table: Table) -> ReleasedBlocks:
        """Drop one reference from each block of ``table``, group by group, last block first;
        report them in table order (group 0's first) and which became free or cached free."""
        block_ids: list[int] = []
        freed: list[int] = []
        cached: list[int] = []
        for group, held in enumerate(table.group_block_ids):
            group_freed, group_cached = self.pool.release(reversed(held), group)
            block_ids += held
            freed += group_freed
            cached += group_cached
        return ReleasedBlocks(tuple(block_ids), tuple(freed), tuple(cached))

    def truncate(self, table: Table, token_count: int) -> ReleasedBlocks:
        """Shrink ``table`` to ``token_count`` tokens in every group: drop the blocks wholly
        past it as ``release`` does, uncache a cached block left partly filled, forget the
        tokens past it. Reports the dropped blocks as ``release`` reports a table's."""
        block_size = self.block_size
        keep = blocks_for_tokens(block_size, token_count)
        held_before = table.token_count
        dropped: list[int] = []
        freed: list[int] = []
        cached: list[int] = []
        stale: list[tuple[int, ...]] = []
        for group, held in enumerate(table.group_block_ids):
            skipped = table.skipped_blocks[group]
            kept = keep - skipped
            group_dropped = held[kept:]
            group_freed, group_cached = self.pool.release(reversed(group_dropped), group)
            dropped += group_dropped
            freed += group_freed
            cached += group_cached
            del held[kept:]
            cache = self.caches[group]
            if token_count % block_size and cache.block_keys[held[-1]] is not None:
                cache.evict(held[-1])
            stale_end = min(held_before, keep * block_size)
            if token_count % block_size == 0 or self.pool.ref_counts[held[-1]] > 1:
                stale_end = token_count  # nothing of a block another table holds is stale
            stale.append(
                tuple(
                    slot_index(block_size, held, p, skipped) for p in range(token_count, stale_end)
                )
            )
        table.token_count = token_count
        if table.token_ids is not None and table.keys is not None:
            del table.token_ids[token_count:]
            del table.keys[token_count // block_size :]
        return ReleasedBlocks(tuple(dropped), tuple(freed), tuple(cached), tuple(stale))

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
        caches = self.caches
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
        host_caches = self.pool.host.caches
        host_found: list[dict[int, int]] = [{} for _ in caches]
        parent: BlockKey | None = None
        parent_hash = caches[0].root_hash(cache_salt)
        longest = hit_limit
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
                    missed = missed or groups[group].window is None
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
            firsts = [group.skip_target(block_size, hit_blocks * block_size) for group in groups]
            if all(
                run[hit_blocks - 1] >= hit_blocks - first
                for run, first in zip(runs, firsts, strict=True)
            ):
                # The run check made every one of these a hit: the filter only narrows type.
                hits = [
                    [b for b in group_found[first:hit_blocks] if b is not None]
                    for group_found, first in zip(found, firsts, strict=True)
                ]
                host_hits = [
                    [(i, on_host[i]) for i in range(first, hit_blocks) if group_found[i] is None]
                    for group_found, on_host, first in zip(found, host_found, firsts, strict=True)
                ]
                return hit_blocks * block_size, hits, host_hits, keys
        return 0, [[] for _ in caches], [[] for _ in caches], keys

    def cache_full_blocks(self, table: Table, first_index: int) -> None:
        """Cache every full block from ``first_index`` on, in every group, unless that
        group caches its prefix already. The caller has keyed every full block: it hashes
        before anything changes, so a hash that raises changes nothing."""
        assert table.token_ids is not None and table.keys is not None, "only token tables cache"
        keys = table.keys
        full_blocks = len(table.token_ids) // self.block_size
        assert len(keys) >= full_blocks, "every full block is keyed before it is cached"
        for cache, held, skipped in zip(
            self.caches, table.group_block_ids, table.skipped_blocks, strict=True
        ):
            for index in range(max(first_index, skipped), full_blocks):
                cache.insert(keys[index], held[index - skipped])


def _hit_runs(found: list[int | None]) -> list[int]:
    """For each block index, how many consecutive indices up to it are cached."""
    runs: list[int] = []
    run = 0
    for block_id in found:
        run = 0 if block_id is None else run + 1
        runs.append(run)
    return runs
