"""The fast, mutable block allocator an engine calls on every step: the article's API.

``KVBlockManager`` holds the operations: each checks every argument, refuses before it
changes anything, and hands the work to the parts that each own one thing:
- ``impl.manager_base``: the fields, the parts and every read-only query;
- ``impl.block_pool``: the free and cached free queues, ref counts, pending copies;
- ``impl.groups``: the KV cache groups (full attention or a sliding window) and every
  table operation across them (growth, the window rule, the prefix-cache hit);
- ``impl.tables``: each request's tables and the read-only views of them;
- ``impl.usage``: the running counters behind ``usage()``;
- ``impl.checking``: the mapping to spec state and ``check_invariants`` (for tests).

It behaves exactly like ``spec.allocator`` (same block ids, same queue orders, same
errors) and is tested against it in lockstep. What it adds is speed: O(1) amortised per
operation, with no scan of the pool, the queues or the tables on any hot path. The decode
appends of a table whose tokens land in its own last block are inlined here.

It is *not* the owner of KV tensors: it hands out block ids (and, for copy-on-write, the
copies to make; for windows, the blocks to poison), and harness/ decides what lives in them.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from impl import swap
from impl.host_operations import HostTierOperations
from impl.records import AppendedSlots, PromptAllocation, RequestBlockTable
from impl.tables import Table
from spec import (
    MAX_TOKEN_ID,
    BlockAllocationError,
    ReleasedBlocks,
    allocated_by_count,
    blocks_for_request,
    blocks_for_tokens,
    check_cache_salt,
    check_request_id,
    check_token_count,
    check_token_ids,
    check_truncate,
    duplicate_request,
    first_window_token,
    tracks_token_ids,
    unknown_request,
)


@dataclass(eq=False)
class KVBlockManager(HostTierOperations):
    """A pool of ``total_blocks`` blocks of ``block_size`` tokens, lent to requests.

    A dataclass, as in the article: a subclass may define ``__post_init__``, call
    ``super().__post_init__()`` and add attributes of its own. The fields, the parts and
    every read-only query are ``impl.manager_base.ManagerBase``'s; this class holds the
    operations, each checking its arguments and refusing before it changes anything.
    """

    # -- operations --------------------------------------------------------------------

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Give a new request blocks for ``token_count`` tokens whose ids are not tracked,
        in every group (group 0's first); returns group 0's table."""
        per_group = self._blocks_for(token_count)
        group_count = len(self.group_windows)
        needed = blocks_for_request(self.block_size, token_count, group_count)
        check_request_id(request_id)
        tables = self._tables
        if request_id in tables or request_id in self._host.swapped:
            duplicate_request(request_id)
        pool = self._pool
        available = pool.free_blocks
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        self._counters.allocated_tokens += token_count
        if self._exclusive_tables:
            # NOTE: one full-attention group, so one list and no window (measured: the
            # general path below costs a fifth more per admission).
            held = pool.take(per_group, 0)
            tables[request_id] = Table([held], token_count, exclusive=True)
            return RequestBlockTable(request_id, list(held), token_count)
        table = Table([pool.take(per_group, group) for group in range(group_count)], token_count)
        if self._windowed:
            self._groups.set_next_skip(table)
        tables[request_id] = table
        return table.snapshot(request_id)

    def allocate_prompt(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> PromptAllocation:
        """Give a new request blocks for its prompt, reusing the longest prefix cached under
        its ``cache_salt`` (``None``: no salt, a namespace of its own).

        Hits never cover the prompt's last token. Every block the prompt fills is cached
        under its salt.
        """
        self._check_new(request_id)
        ids = tuple(token_ids)
        check_token_ids(ids)
        check_cache_salt(cache_salt)
        cached_tokens, group_hits, group_host_hits, keys = self._groups.match(ids, cache_salt)
        pool = self._pool
        per_group = blocks_for_tokens(self.block_size, len(ids)) - cached_tokens // self.block_size
        needed = per_group * len(self.group_windows) + sum(map(len, group_host_hits))
        cached_free = pool.cached_free  # an in-flight hit is unreferenced but not free
        revived = sum(1 for hits in group_hits for b in hits if b in cached_free)
        available = pool.free_blocks - revived
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        # Every block is hashed before anything changes: a hash that raises changes nothing.
        self._groups.caches[0].extend_keys(ids, keys, self.block_size, cache_salt)
        for group, hits in enumerate(group_hits):
            pool.revive(hits, group)
        if any(group_host_hits):
            held = swap.held_after_host_hits(
                self._pool,
                self._groups,
                cached_tokens=cached_tokens,
                group_hits=group_hits,
                group_host_hits=group_host_hits,
                keys=keys,
                per_group=per_group,
            )
        else:
            held = [hits + pool.take(per_group, group) for group, hits in enumerate(group_hits)]
        table = Table(held, len(ids), list(ids), keys, cache_salt=cache_salt)
        self._groups.set_skipped(table, cached_tokens)
        self._tables[request_id] = table
        self._counters.allocated_tokens += len(ids)
        self._counters.prefix_hit_tokens += cached_tokens
        self._groups.cache_full_blocks(table, cached_tokens // self.block_size)
        return PromptAllocation(table.snapshot(request_id), cached_tokens)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        """Grow a request allocated by count by ``token_count`` tokens; returns a snapshot.

        The snapshot copies the table (O(blocks)), as the article's does; a decode loop
        that needs no snapshot should call ``append_slot`` (O(1)).
        """
        if type(token_count) is not int or token_count < 0:
            check_token_count(token_count)
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        position = table.token_count
        if table.exclusive and token_count <= -position % self.block_size:
            # NOTE: the article's decode step inlined: the tokens fit in the request's own
            # last block, so nothing but counts changes (measured: 1.4 -> 0.6 us a call).
            table.token_count = position + token_count
            self._counters.allocated_tokens += token_count
            return RequestBlockTable(
                request_id, list(table.group_block_ids[0]), position + token_count
            )
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, token_count)
        return table.snapshot(request_id)

    def append_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        """``append_tokens``, returning what the step needs: every group's table and the
        new tokens' slots in each (O(blocks + tokens added))."""
        check_token_count(token_count)
        table = self._table(request_id)
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, token_count)
        return self._appended_slots(request_id, table, token_count)

    def append_token_id_slots(self, request_id: str, token_ids: Sequence[int]) -> AppendedSlots:
        """``append_token_ids``, returning what the step needs: every group's table and the
        new tokens' slots in each."""
        ids = tuple(token_ids)
        table = self._add_token_ids(request_id, ids)
        return self._appended_slots(request_id, table, len(ids))

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> RequestBlockTable:
        """Grow a request allocated by ``allocate_prompt`` by these tokens; returns a snapshot.

        Every block the new tokens fill becomes cached.
        """
        return self._add_token_ids(request_id, tuple(token_ids)).snapshot(request_id)

    def _add_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> Table:
        table = self._table(request_id)
        if table.token_ids is None:
            allocated_by_count(request_id)
        check_token_ids(token_ids)
        assert table.keys is not None, "a table with token ids has keys"
        first_index = table.token_count // self.block_size
        # Hashed before anything changes: a hash that raises changes nothing.
        new_keys = self._groups.caches[0].next_keys(
            table.token_ids, table.keys, token_ids, self.block_size, table.cache_salt
        )
        self._groups.grow(request_id, table, len(token_ids))
        table.token_ids.extend(token_ids)
        table.keys.extend(new_keys)
        self._groups.cache_full_blocks(table, first_index)
        return table

    def append_slot(self, request_id: str) -> int:
        """Grow a request allocated by count by one token; return that token's pool slot.

        The hot path of decoding: O(1), no copy. The slot is ``block_id * block_size +
        offset``, the row of the KV pool the new token's K/V go to. Same effect on the
        allocator as ``append_tokens(request_id, 1)``.
        """
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)  # NOTE: inlined, not ``_table``: a call is a fifth here
        position = table.token_count
        block_size = self.block_size
        offset = position % block_size
        if offset and table.exclusive:
            # NOTE: the decode fast path, ``spec.slot_index`` of the last token inlined: the
            # token lands in the request's own last block.
            table.token_count = position + 1
            self._counters.allocated_tokens += 1
            return table.group_block_ids[0][-1] * block_size + offset
        if table.token_ids is not None:
            tracks_token_ids(request_id)
        self._groups.grow(request_id, table, 1)
        return table.group_block_ids[0][-1] * block_size + offset

    def append_token_slot(self, request_id: str, token_id: int) -> int:
        """Grow a request allocated by ``allocate_prompt`` by one token; return its slot.

        The hot path of decoding with prefix caching; O(1) but when the token fills a
        block, which is then hashed and cached. Same effect as ``append_token_ids``.
        """
        try:
            table = self._tables[request_id]
        except KeyError:
            unknown_request(request_id)
        token_ids = table.token_ids
        if token_ids is None:
            allocated_by_count(request_id)
        if type(token_id) is not int or not 0 <= token_id <= MAX_TOKEN_ID:
            check_token_ids((token_id,))
        position = table.token_count
        block_size = self.block_size
        offset = position % block_size
        block_ids = table.group_block_ids[0]
        if (
            0 < offset < block_size - 1
            and self._exclusive_tables
            and self._ref_counts[block_ids[-1]] == 1
        ):
            # NOTE: the in-block case of ``KVCacheGroups.grow`` inlined for one
            # full-attention group, before any key is read (a call or a test is a
            # tenth of this path): the token lands in the request's own last block and
            # fills nothing, so nothing is hashed.
            table.token_count = position + 1
            self._counters.allocated_tokens += 1
            token_ids.append(token_id)
            return block_ids[-1] * block_size + offset
        keys = table.keys
        assert keys is not None, "a table with token ids has keys"
        cache = self._groups.caches[0]
        new_key = None
        if offset == block_size - 1:
            # The token fills its block: keyed before anything changes, so that a hash
            # that raises changes nothing.
            chunk = (*token_ids[position - offset :], token_id)
            new_key = cache.chain_key(keys[-1] if keys else None, chunk, table.cache_salt)
        if offset and self._exclusive_tables and self._ref_counts[block_ids[-1]] == 1:
            # The same in-block case for the token that fills the block (keyed above).
            table.token_count = position + 1
            self._counters.allocated_tokens += 1
        else:
            self._groups.grow(request_id, table, 1)  # opens a block or copies a shared one
        token_ids.append(token_id)
        if new_key is not None:
            keys.append(new_key)
            if self._exclusive_tables:  # one full-attention group: its last block
                cache.insert(new_key, block_ids[-1])
            else:
                self._groups.cache_full_blocks(table, position // block_size)
        return block_ids[-1] * block_size + offset

    def fork(self, parent_id: str, child_id: str) -> RequestBlockTable:
        """Give ``child_id`` a table sharing every block of ``parent_id``; O(blocks).

        Takes no block. Whichever side later appends into a shared, partly filled last
        block gets a copy of it first (see ``take_copies``).
        """
        parent = self._table(parent_id)
        self._check_new(child_id)
        child = parent.copy()
        self._tables[child_id] = child
        for held in parent.group_block_ids:
            for block_id in held:
                self._pool.add_reference(block_id)
        parent.exclusive = child.exclusive = False
        self._counters.allocated_tokens += parent.token_count
        return child.snapshot(child_id)

    def release(self, request_id: str) -> list[int]:
        """Drop a request; each block loses a reference, last block first. Returns the
        request's block ids in table order, as the article's does.

        A block left unreferenced joins the tail of the cached free queue if it holds a
        cached prefix, else the tail of the free queue. ``release_blocks`` does the same
        and also says which blocks became free.
        """
        table = self._tables.get(request_id)
        if table is None or not table.exclusive:  # a swapped-out request too
            return list(self.release_blocks(request_id).block_ids)
        del self._tables[request_id]
        self._counters.allocated_tokens -= table.token_count
        block_ids = table.group_block_ids[0]  # exclusive: one group, so every block
        self._pool.release_exclusive(block_ids)
        return block_ids  # the table is gone: its own list can be handed out

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        """``release``, reporting which of the request's blocks became free, and where to:
        every group's blocks, group 0's first, each group's last block first. A swapped-out
        request's host blocks are freed (it holds no device block)."""
        table = self._tables.get(request_id)
        if table is None:
            if request_id in self._host.swapped:
                return swap.release_swapped(self._pool, request_id)
            unknown_request(request_id)
        del self._tables[request_id]
        self._counters.allocated_tokens -= table.token_count
        return self._groups.release(table)

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        """Shrink a request to its first ``token_count`` tokens (the rollback of rejected
        speculative tokens); returns a snapshot. O(blocks dropped).

        The blocks wholly past the new length are dropped as ``release`` drops them; a
        cached full block left partly filled stops being cached (see ``spec.truncate``).
        """
        self.truncate_blocks(request_id, token_count)
        return self._tables[request_id].snapshot(request_id)

    def truncate_blocks(self, request_id: str, token_count: int) -> ReleasedBlocks:
        """``truncate``, reporting the blocks it dropped (every group's, group 0's first, in
        table order) and which of them became free or cached free (group by group, last
        first), as ``release_blocks`` reports a whole table. The engine poisons
        ``freed_block_ids`` after rolling back rejected drafts."""
        if type(token_count) is not int or token_count < 0:
            check_token_count(token_count)
        table = self._table(request_id)
        check_truncate(
            request_id,
            token_count,
            table.token_count,
            block_size=self.block_size,
            group_windows=self.group_windows,
            skipped_blocks=table.skipped_blocks,
            first_reads=[first_window_token(token_count, w) for w in self.group_windows],
        )
        self._counters.allocated_tokens -= table.token_count - token_count
        return self._groups.truncate(table, token_count)

    def preempt(self, request_id: str) -> ReleasedBlocks:
        """Release a request the engine preempts to recompute later; counts the preemption."""
        released = self.release_blocks(request_id)
        self._counters.preemptions += 1
        return released

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``spec.reset_prefix_cache``): cached free blocks
        become plain free blocks at the free queue's tail, in their queue order; held
        blocks keep their K/V but no later prompt hits them. Never refused; returns how
        many cached blocks were dropped. O(pool): for a weight reload, not a step."""
        return self._pool.reset_caches()

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (source, destination) to perform now, in order; clears them.

        The engine copies each source block's K/V to its destination before the step's
        forward pass writes into the destination.
        """
        return self._pool.take_copies()

    def take_skipped_blocks(self) -> list[int]:
        """The blocks sliding windows made free and uncached since the last call, in the
        order they were released; clears them. The engine poisons their K/V: nothing may
        read it again. A block an allocation took meanwhile is not among them."""
        return self._pool.take_skipped()
