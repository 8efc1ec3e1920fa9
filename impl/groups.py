"""Every table operation across the KV cache groups of a pool.

``KVCacheGroups`` applies an operation to a request's table in every group, group 0
first, asking each group's kind (``impl.group_kinds``) where the kinds' rules differ:
growing a table (``grow``: the in-block case, ``Table.room``, is its callers'; an early
return for one group opening blocks; then the general path), forking, releasing,
truncating. A prompt's prefix hit across the groups is ``impl.prefix_hits``'.

It takes blocks from the ``BlockPool`` and gives them back through the host tier
(``HostTier.keep_in_flight``: the blocks a pending copy still needs wait there), and never
checks arguments: the front (``impl.manager``) has done that before it calls in.
"""

from collections.abc import Mapping
from itertools import islice
from typing import ClassVar

from impl.block_pool import BlockPool
from impl.group_kinds import IMPL_KINDS, FullAttentionGroup, impl_kinds
from impl.host_tier import GroupBlock, HostTier, SwappedRequest
from impl.prefix_cache import BlockHash, BlockKey
from impl.tables import Table
from spec import (
    BlockAllocationError,
    GroupKind,
    ReleasedBlocks,
    errors,
    slot_index,
)


class KVCacheGroups:
    """The pool's groups, in order, and the operations that touch a table in each.

    ``groups[g]`` is group g's kind (of ``group_windows[g]``) and ``pool.caches[g]`` its
    prefix cache; ``host`` keeps the blocks a copy between the tiers still needs.
    """

    __slots__ = (
        "block_hash",
        "block_size",
        "checkpointing",
        "fast_open",
        "groups",
        "host",
        "pool",
        "slotless_groups",
        "windowed",
    )

    # The impl class of each kind; a subclass may swap one (the planted bugs of the tests do).
    kind_classes: ClassVar[Mapping[type, type[FullAttentionGroup]]] = IMPL_KINDS

    def __init__(
        self,
        block_size: int,
        group_windows: tuple[GroupKind, ...],
        pool: BlockPool,
        host: HostTier,
        block_hash: BlockHash,
    ) -> None:
        self.block_size = block_size
        self.groups = impl_kinds(group_windows, self.kind_classes)
        # Whether some group ever skips a block (else a table's skips stay 0, its next skip
        # NEVER: ``Table``'s defaults).
        self.windowed = any(kind.next_skip_at(block_size, 0) is not None for kind in group_windows)
        # The groups whose blocks hold no per-token slot: a table's ``slotless_groups``.
        self.slotless_groups = tuple(g for g, kind in enumerate(self.groups) if not kind.has_slots)
        # The groups whose kind may checkpoint a table's running block as it grows.
        self.checkpointing = tuple(g for g, kind in enumerate(self.groups) if kind.checkpoints)
        # Whether ``grow`` may take its block-opening case: one group, growing by token.
        self.fast_open = len(self.groups) == 1 and self.groups[0].grows_by_token
        self.pool = pool
        self.host = host
        self.block_hash = block_hash

    # -- a table's state ------------------------------------------------------------------

    def new_table(self, request_id: str, token_count: int) -> Table:
        """A new table of ``token_count`` tokens allocated by count: each group's kind's
        ``table_blocks`` (group 0's first). Refused (``BlockAllocationError``) when the pool
        holds fewer than that."""
        block_size = self.block_size
        per_group = [kind.table_blocks(block_size, token_count) for kind in self.groups]
        needed = sum(per_group)
        available = self.pool.free_blocks
        if needed > available:
            raise BlockAllocationError.out_of_blocks(request_id, needed, available)
        held = [self.pool.take(count, group) for group, count in enumerate(per_group)]
        table = Table(held, token_count, slotless_groups=self.slotless_groups)
        self.set_skipped(table, 0)
        return table

    def set_skipped(self, table: Table, computed_tokens: int) -> None:
        """Give a new ``table`` the skips of a request whose first ``computed_tokens`` tokens
        are computed (a prompt's hit: the blocks before it are born skipped), and its room."""
        if self.windowed:  # else a table skips nothing, ever (``Table``'s defaults)
            block_size = self.block_size
            table.skipped_blocks = [
                group.skip_target(block_size, computed_tokens) for group in self.groups
            ]
            self.set_next_skip(table)
        self.set_room(table)

    def set_next_skip(self, table: Table) -> None:
        """``table.next_skip_at``: the least length at which some group skips a block more."""
        block_size = self.block_size
        table.next_skip_at = min(
            group.next_skip_at(block_size, skipped)
            for group, skipped in zip(self.groups, table.skipped_blocks, strict=True)
        )

    def set_room(self, table: Table, *, own_last_blocks: bool = False) -> None:
        """``table.room``: the tokens the next appends may add to every group's own last
        block, filling none a cache would key, before any window slides. With
        ``own_last_blocks`` the caller knows no other table holds a last block and none is
        cached (it has just written into them)."""
        position = table.token_count
        room = -position % self.block_size
        if table.token_ids is not None:
            room -= 1  # the token that fills a block is hashed and cached: the general path
        if room > 0:
            room = min(room, table.next_skip_at - position)
        if room > 0 and not own_last_blocks:
            ref_counts = self.pool.ref_counts
            caches = self.pool.caches
            for group, held in enumerate(table.group_block_ids):
                last = held[-1]
                if ref_counts[last] != 1:
                    room = 0  # shared: the next append copies it first
                    break
                if caches[group].block_keys[last] is not None:
                    # Cached: the next append forgets its key (a rollback kept it) or, by
                    # its kind's write rule, copies it first.
                    room = 0
                    break
        table.room = max(room, 0)

    # -- growth ---------------------------------------------------------------------------

    def grow(self, request_id: str, table: Table, token_count: int) -> None:
        """Add ``token_count`` tokens to every group's table: the window rule first (what each
        windowed group skips at L0 = the tokens before), then each group's new blocks, group
        0's first, copying a shared partly filled last block before the new ones.

        Atomic: the blocks the skips would free count as available, and nothing changes
        until the check has passed. Never called for tokens that fit ``table.room``: every
        caller takes that in-block case itself (only the length changes), so it is not here.
        """
        block_size = self.block_size
        position = table.token_count
        pool = self.pool
        ref_counts = pool.ref_counts
        # NOTE: ``blocks_for_tokens`` inlined (its checks are the front's): a call is a
        # tenth of opening a block.
        blocks = -(-(position + token_count) // block_size)
        group_block_ids = table.group_block_ids
        if (
            position % block_size == 0
            and position < table.next_skip_at
            and self.fast_open
            and token_count
        ):
            # NOTE: the block-opening case of a single group: the tokens start a block and
            # no window slides, so the table only takes its missing blocks (a decode
            # append, 1 of every 16 with blocks of 16; measured: 1.8 -> 1.1 us a call).
            held = group_block_ids[0]
            missing = blocks - table.skipped_blocks[0] - len(held)
            available = pool.free_blocks
            if missing > available:
                raise BlockAllocationError.out_of_blocks(request_id, missing, available)
            held.extend(pool.take(missing, 0))
            table.changed()
            table.token_count = end = position + token_count
            # ``set_room`` inlined: the new last block is the table's own.
            room = -end % block_size - (table.token_ids is not None)
            table.room = max(min(room, table.next_skip_at - end), 0)
            return
        drops: list[int] | None = None
        freed_by_skips = 0
        if position >= table.next_skip_at:
            drops = []
            for kind, held, skipped in zip(
                self.groups, table.group_block_ids, table.skipped_blocks, strict=True
            ):
                drop = max(kind.skip_target(block_size, position) - skipped, 0)
                # O(drop): each block of a table is skipped once: O(1) amortised per token.
                # A skipped block a pending copy between the tiers touches goes in flight.
                freed_by_skips += sum(
                    1
                    for block_id in held[:drop]
                    if ref_counts[block_id] == 1 and not self.host.is_copying(block_id)
                )
                drops.append(drop)
        needed: list[int] = []
        copies: list[int] = []  # the groups whose last block is copied before the write
        forgets: list[int] = []  # ... and those whose cached last block forgets its key
        caches = pool.caches
        checkpoints: dict[int, BlockKey] = {
            group: key
            for group in self.checkpointing
            if (key := self.groups[group].checkpoint_key(table, token_count, caches[group]))
        }
        end = position + token_count
        for group, (kind, held) in enumerate(zip(self.groups, group_block_ids, strict=True)):
            spec_kind = kind.spec
            count = kind.table_blocks(block_size, end) - table.skipped_blocks[group] - len(held)
            if token_count and spec_kind.rewrites_last_block(block_size, position):
                last = held[-1]
                cached = group in checkpoints or caches[group].block_keys[last] is not None
                if spec_kind.copies_before_write(ref_counts[last] > 1, cached):
                    copies.append(group)
                    count += 1
                elif cached:
                    forgets.append(group)  # a rollback kept its key: this write changes it
            needed.append(count)
        total = sum(needed)
        available = pool.free_blocks + freed_by_skips
        if total > available:
            raise BlockAllocationError.out_of_blocks(request_id, total, available)
        if drops is not None:
            for group, drop in enumerate(drops):
                if drop:
                    self.skip(table, group, drop)
        for group, held in enumerate(group_block_ids):
            count = needed[group]
            if checkpoints and group in checkpoints:
                caches[group].insert(checkpoints[group], held[-1])
            if count:
                taken = pool.take(count, group)
                if copies and group in copies:
                    self.copy_before_write(held, taken.pop(0), group)
                held.extend(taken)
                table.changed()
            if forgets and group in forgets:
                caches[group].evict(held[-1 - count])
        table.token_count = position + token_count
        # Tokens added land in each group's own last block: one just taken, a copy of a
        # shared one, or one it held alone.
        self.set_room(table, own_last_blocks=token_count > 0)

    def copy_before_write(self, held: list[int], destination: int, group: int) -> None:
        """The write rule: ``destination`` replaces the last block of ``held``, the copy
        waits for ``take_copies``, and the table's reference to the old block goes as
        ``release`` drops one."""
        source = held[-1]
        self.pool.copy_last_block(held, destination)
        self.give_back([source], group)

    def fork(self, parent: Table) -> Table:
        """A table sharing every block of ``parent``, one more reference each (for the
        caller to file under the child's id)."""
        child = parent.copy()
        for held in parent.group_block_ids:
            for block_id in held:
                self.pool.add_reference(block_id)
        self.set_room(parent)
        self.set_room(child)
        return child

    def skip(self, table: Table, group: int, drop: int) -> None:
        """Release the first ``drop`` blocks ``table`` holds in ``group``, in block index
        order (never demoted: see ``spec.growth``); those that became free and uncached wait
        for ``take_skipped``."""
        held = table.group_block_ids[group]
        freed, _ = self.give_back(held[:drop], group, demote=False)
        self.pool.add_skipped(freed)
        # NOTE: ``del`` at the front moves the rest of the list (a C memmove), and a windowed
        # table holds about (W + tokens added at once) / block_size blocks whatever the
        # request's length, so this stays bounded by the window, not the request.
        del held[:drop]
        table.skipped_blocks[group] += drop
        table.changed()
        self.set_next_skip(table)
        self.pool.skipped_blocks += drop

    # -- the host tier --------------------------------------------------------------------

    def check_swap_out(self, request_id: str, table: Table) -> None:
        """Refuse to swap ``table`` out while a pending copy writes into one of its blocks
        (``ValueError``) or when the host tier is absent or short
        (``HostBlockAllocationError``)."""
        host = self.host
        awaited = {destination for _, destination in self.pool.pending_copies}
        awaited.update(destination for _, destination in host.pending_in)
        if awaited:
            for held in table.group_block_ids:
                for block_id in held:
                    if block_id in awaited:
                        errors.awaits_copy(request_id, block_id)
        device_ids = [block_id for held in table.group_block_ids for block_id in held]
        errors.check_host_room(request_id, len(device_ids), host.free_blocks, host.host_blocks)

    def copy_to_host(self, request_id: str, table: Table) -> ReleasedBlocks:
        """Give each block of ``table`` (removed from the tables by the caller) a host block,
        queue the copies out, drop the table's references as ``release`` does and file the
        table as swapped out. Reports its blocks and those in flight that will be free or
        cached free once their copies are taken."""
        host = self.host
        device_ids = [block_id for held in table.group_block_ids for block_id in held]
        host_ids = host.take(len(device_ids))
        host.copy_out(device_ids, host_ids)
        # NOTE: nothing leaves flight during this release (no block of the table awaits a
        # copy in: the front refused that), so the blocks it sends in flight are the
        # dict's new tail.
        in_flight_before = len(host.in_flight)
        self.release(table)
        went = list(islice(host.in_flight.items(), in_flight_before, None))
        host.hold_swapped(request_id, table, host_ids)
        caches = self.pool.caches
        return ReleasedBlocks(
            tuple(device_ids),
            tuple(b for b, group in went if caches[group].block_keys[b] is None),
            tuple(b for b, group in went if caches[group].block_keys[b] is not None),
        )

    def copy_from_host(self, request_id: str, swapped: SwappedRequest) -> Table:
        """Give a swapped-out request fresh device blocks, one per host block, group by group
        (copies in queued); returns its table for the caller to file again."""
        device_ids = [
            self.pool.take(len(host_ids), group)
            for group, host_ids in enumerate(swapped.group_host_block_ids)
        ]
        table = self.host.resume_swapped(request_id, device_ids)
        self.set_room(table)
        return table

    # -- giving blocks back ---------------------------------------------------------------

    def give_back(
        self, block_ids: list[int], group: int, *, demote: bool = True
    ) -> tuple[list[int], list[int]]:
        """Drop one reference from each of ``block_ids`` of ``group``, in order; a block left
        with none stays in flight if the host tier still needs it, else joins the cached
        free queue if the group caches it, or the free queue. Returns the blocks that went
        to each queue."""
        unreferenced = self.pool.drop(block_ids, group)
        if not unreferenced:
            return [], []
        cache = self.pool.caches[group]
        rest = self.host.keep_in_flight(unreferenced, group, cache, demote=demote)
        return self.pool.queue(rest, group)

    def queue_copied(self, done: list[GroupBlock]) -> tuple[list[int], list[int]]:
        """Queue the in-flight blocks whose copies are done (``HostTier.copied``), in order;
        returns those that went to the free and the cached free queue."""
        freed: list[int] = []
        cached: list[int] = []
        for block_id, group in done:
            group_freed, group_cached = self.pool.queue([block_id], group)
            freed += group_freed
            cached += group_cached
        return freed, cached

    def release(self, table: Table) -> tuple[list[int], list[int]]:
        """Drop one reference from each block of ``table``, group by group, last block first;
        returns the blocks that became free and those that became cached free."""
        groups = enumerate(table.group_block_ids)
        _, held = next(groups)
        freed, cached = self.give_back(held[::-1], 0)
        for group, held in groups:
            group_freed, group_cached = self.give_back(held[::-1], group)
            freed += group_freed
            cached += group_cached
        return freed, cached

    def truncate(self, table: Table, token_count: int) -> ReleasedBlocks:
        """Shrink ``table`` to ``token_count`` tokens in every group: drop the blocks wholly
        past it as ``release`` does, forget the tokens past it (a cached block left partly
        filled keeps its key until a write: ``spec.releasing.truncate``). Reports the
        dropped blocks as ``release`` reports a table's, and the stale slots of each
        group's kept last block."""
        block_size = self.block_size
        held_before = table.token_count
        dropped: list[int] = []
        freed: list[int] = []
        cached: list[int] = []
        stale: list[tuple[int, ...]] = []
        for group, held in enumerate(table.group_block_ids):
            keep = self.groups[group].table_blocks(block_size, token_count)
            skipped = table.skipped_blocks[group]
            kept = keep - skipped
            group_dropped = held[kept:]
            group_freed, group_cached = self.give_back(group_dropped[::-1], group)
            dropped += group_dropped
            freed += group_freed
            cached += group_cached
            del held[kept:]
            stale_end = min(held_before, keep * block_size)
            pool = self.pool
            if not token_count % block_size or (
                pool.ref_counts[held[-1]] > 1 or pool.caches[group].block_keys[held[-1]]
            ):
                # Nothing of a block another table holds is stale, nor of a cached one: its
                # slots are its key's K/V until a write changes it.
                stale_end = token_count
            stale.append(
                tuple(
                    slot_index(block_size, held, p, skipped) for p in range(token_count, stale_end)
                )
            )
        table.token_count = token_count
        table.changed()
        if table.token_ids is not None and table.keys is not None:
            del table.token_ids[token_count:]
            del table.keys[token_count // block_size :]
        self.set_room(table)
        return ReleasedBlocks(tuple(dropped), tuple(freed), tuple(cached), tuple(stale))
