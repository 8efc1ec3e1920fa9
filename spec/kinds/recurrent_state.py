"""The recurrent state kind of KV cache group, ``RecurrentState``: its rules.

A state group holds the layers of a hybrid model (Mamba-2, gated DeltaNet, LFM2's short
convolution) whose per-request state is one fixed-size tensor after the tokens seen so
far, not a K/V that grows by token. Its rules, which the transitions of ``spec.growth``,
``spec.caching`` and ``spec.releasing`` follow by asking the kind:

- What a request holds. Exactly one block in a state group, its running state, from its
  allocation until its release, whatever its length (``table_blocks``); it never skips.
  The state in it is the state after the request's first L0 tokens, L0 its length before
  its next adding operation (the engine computes a request's tokens before it adds more,
  the contract pagedkv already caches filled blocks under). A state group has no per-token
  slot: ``AppendedSlots.slots`` is empty for it.
- Checkpoints. An adding operation of at least one token on a request that tracks token
  ids, with L0 a positive multiple of the group's ``interval`` C
  (``RecurrentState.is_checkpoint_at``), first caches the running block under
  ``CacheKey(salt, token_ids[:L0])`` in the group's prefix cache (a ``BlockStored``),
  unless a block is cached under that key already. C is a multiple of block_size, so a
  checkpoint ends on a block boundary.
- The write rule (copy-on-write of the whole state). An adding operation of at least one
  token whose running block is shared (a fork) or cached (a checkpoint: just made, or made
  by a fork's other side) takes a fresh block (free queue first, then evicting), queues
  the (old, fresh) copy with the copy-on-write copies, and drops its reference to the old
  block, which goes where ``release`` sends a block: a checkpoint to the cached free
  queue's tail. So a cached state is never written again: a table holds one only while its
  length is the checkpoint's (a fork's other side, which has not added to it since).
- A prefix hit of h tokens needs, in a state group, h == 0 or a checkpoint cached on the
  device under exactly ``CacheKey(salt, token_ids[:h])``; the common hit is the largest h
  every group allows (``spec.caching``). On h > 0 the new request holds the checkpoint
  (taken back from the cached free queue: not available to its own allocation), then the
  write rule copies it into a fresh block in the same call.
- No rewind. ``truncate`` below a request's length is refused in a pool with a state group
  (a state cannot be rewound); preemption is release and recompute: the readmission hits
  the last checkpoint still cached.
- The host tier is refused beside a state group (``RecurrentState.check``): a checkpoint
  is never demoted, and a swap of a running state is not specified yet.

Where a copy's source is freed before ``take_transfers`` (a fork's shared state released
by the other side), the rule is copy-on-write's of a partly filled block: the KV pool
makes the copies, in order, before the next forward, and the engine takes the transfers
before it releases a request in the middle of a step.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import combinations

from spec.records import CacheKey, GroupView, RequestBlockTable


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """A KV cache group of recurrent state layers, checkpointed every ``interval`` tokens
    (a positive multiple of the pool's block size)."""

    interval: int

    @property
    def name(self) -> str:
        return f"recurrent state checkpointed every {self.interval}"

    @property
    def window(self) -> int | None:
        """A state group reads no key and skips nothing: ``None``, as full attention."""
        return None

    def check(self, group: int, block_size: int, host_blocks: int) -> None:
        """Refuse an interval that is not an ``int`` (TypeError) that is a positive multiple
        of ``block_size`` (ValueError: a checkpoint ends on a block boundary), and a host
        tier beside a state group (ValueError: not specified yet)."""
        interval = self.interval
        if type(interval) is not int:
            raise TypeError(
                f"interval of state group {group} must be an int, "
                f"got {type(interval).__name__} {interval!r}"
            )
        if interval < 1 or interval % block_size:
            raise ValueError(
                f"interval of state group {group} must be a positive multiple of the block "
                f"size {block_size}, got {interval}"
            )
        if host_blocks:
            raise ValueError(
                f"state group {group} cannot share a pool with a host tier yet: "
                f"host_blocks must be 0, got {host_blocks}"
            )

    def first_read(self, token_count: int) -> int:
        return 0

    def skipped_blocks_at(self, block_size: int, computed_tokens: int) -> int:
        return 0

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int | None:
        return None

    def table_blocks(self, block_size: int, token_count: int) -> int:
        """One block, the running state, whatever the length."""
        return 1

    def hit_keys(
        self, block_size: int, token_ids: tuple[int, ...], hit_tokens: int, cache_salt: str | None
    ) -> tuple[CacheKey, ...]:
        """A hit of h > 0 tokens needs the checkpoint of exactly the first h tokens."""
        return (CacheKey(cache_salt, token_ids[:hit_tokens]),) if hit_tokens else ()

    def keyed_block_indices(
        self, block_size: int, first_index: int, skipped_blocks: int, token_count: int
    ) -> range:
        """None: a state group caches checkpoints, not blocks by their tokens."""
        return range(0)

    def is_checkpoint_at(self, computed_tokens: int) -> bool:
        """Whether a request whose first ``computed_tokens`` (L0) are computed is
        checkpointed: L0 a positive multiple of the interval."""
        return computed_tokens > 0 and computed_tokens % self.interval == 0

    def rewrites_last_block(self, block_size: int, computed_tokens: int) -> bool:
        """Always: every token added changes the state."""
        return True

    def copies_before_write(self, shared: bool, cached: bool) -> bool:
        """The write rule: a shared or cached running state is copied, never written."""
        return shared or cached

    def check_truncate(
        self, group: int, request_id: str, held_tokens: int, token_count: int
    ) -> None:
        """Refuse (ValueError) to truncate below the request's length: a recurrent state
        cannot be rewound."""
        if token_count < held_tokens:
            raise ValueError(
                f"cannot truncate request {request_id!r} from {held_tokens} to "
                f"{token_count} tokens: state group {group} holds a recurrent state, "
                "which cannot be rewound"
            )

    def slots(self, block_size: int, table: RequestBlockTable, positions: range) -> tuple[int, ...]:
        """None: the one block holds a state, not a token's K/V."""
        return ()

    def is_table_sized(self, block_size: int, table: RequestBlockTable) -> bool:
        """A table holds exactly one block, its running state, and skips none."""
        return len(table.block_ids) == 1 and table.skipped_blocks == 0

    def invariants(self) -> Mapping[str, Callable[[GroupView], bool]]:
        """The named invariants of a state group (``spec.invariants``)."""
        return {
            "checkpoint_unwritten": is_checkpoint_unwritten,
            "checkpoint_on_grid": self.is_checkpoint_on_grid,
            "state_shared_only_by_forks": is_state_shared_only_by_forks,
        }

    def is_checkpoint_on_grid(self, view: GroupView) -> bool:
        """Every checkpoint is keyed by a prefix whose length is a positive multiple of the
        interval: the tokens its state is after."""
        return all(self.is_checkpoint_at(len(key.token_ids)) for key in view.cache)


def is_checkpoint_unwritten(view: GroupView) -> bool:
    """A cached block (a checkpoint) is held only by tables whose token ids and salt are
    exactly its key's: the write rule copies it before any table adds to it, so a cached
    state is never written again."""
    key_of = {block_id: key for key, block_id in view.cache.items()}
    for table in view.tables.values():
        key = key_of.get(table.block_ids[0]) if table.block_ids else None
        if key is None:
            continue
        ids = view.token_ids.get(table.request_id)
        if ids != key.token_ids or view.cache_salts.get(table.request_id) != key.cache_salt:
            return False
    return True


def is_state_shared_only_by_forks(view: GroupView) -> bool:
    """Two tables share their block only at the same length, over the same token ids where
    both track them: a fork neither side has added to since."""
    for first, second in combinations(view.tables.values(), 2):
        if first.block_ids != second.block_ids:
            continue
        if first.token_count != second.token_count:
            return False
        first_ids = view.token_ids.get(first.request_id)
        second_ids = view.token_ids.get(second.request_id)
        if first_ids is not None and second_ids is not None and first_ids != second_ids:
            return False
    return True
