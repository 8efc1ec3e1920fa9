"""The kinds of KV cache group, and the arithmetic of the recurrent state kind.

A group is full attention (``None``), a sliding window of W tokens (an ``int`` W), or a
recurrent state group (``RecurrentState``): the layers of a hybrid model (Mamba-2, gated
DeltaNet, LFM2's short convolution) whose per-request state is one fixed-size tensor
after the tokens seen so far, not a K/V that grows by token. Its rules, which the
transitions of ``spec.growth``, ``spec.caching`` and ``spec.releasing`` follow:

- What a request holds. Exactly one block in a state group, its running state, from its
  allocation until its release, whatever its length (``blocks_for_group``); it never
  skips. The state in it is the state after the request's first L0 tokens, L0 its length
  before its next adding operation (the engine computes a request's tokens before it adds
  more, the contract pagedkv already caches filled blocks under). A state group has no
  per-token slot: ``AppendedSlots.slots`` is empty for it.
- Checkpoints. An adding operation of at least one token on a request that tracks token
  ids, with L0 a positive multiple of the group's ``interval`` C (``is_checkpoint_at``),
  first caches the running block under ``CacheKey(salt, token_ids[:L0])`` in the group's
  prefix cache (a ``BlockStored``), unless a block is cached under that key already. C is
  a multiple of block_size, so a checkpoint ends on a block boundary.
- The write rule (copy-on-write of the whole state). An adding operation of at least one
  token whose running block is shared (a fork) or cached (a checkpoint: just made, or
  made by a fork's other side) takes
  a fresh block (free queue first, then evicting), queues the (old, fresh) copy with the
  copy-on-write copies, and drops its reference to the old block, which goes where
  ``release`` sends a block: a checkpoint to the cached free queue's tail. So a cached
  state is never written again: a table holds one only while its length is the
  checkpoint's (a fork's other side, which has not added to it since).
- A prefix hit of h tokens needs, in a state group, h == 0 or a checkpoint cached on the
  device under exactly ``CacheKey(salt, token_ids[:h])``; the common hit is the largest h
  every group allows (``spec.caching``). On h > 0 the new request holds the checkpoint
  (taken back from the cached free queue: not available to its own allocation), then the
  write rule copies it into a fresh block in the same call.
- No rewind. ``truncate`` below a request's length is refused in a pool with a state
  group (a state cannot be rewound); preemption is release and recompute: the readmission
  hits the last checkpoint still cached.
- The host tier is refused beside a state group (``spec.errors.check_host_tier``): a
  checkpoint is never demoted, and a swap of a running state is not specified yet.

Where a copy's source is freed before ``take_transfers`` (a fork's shared state released
by the other side), the rule is copy-on-write's of a partly filled block: the KV pool
makes the copies, in order, before the next forward, and the engine takes the transfers
before it releases a request in the middle of a step.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """A KV cache group of recurrent state layers, checkpointed every ``interval`` tokens
    (a positive multiple of the pool's block size)."""

    interval: int


# What ``group_windows`` lists, one per group: None, a window W, or a state group.
GroupKind = int | RecurrentState | None


def attention_window(kind: GroupKind) -> int | None:
    """The window a group's queries read (``None``: every key); a state group reads no key
    and skips nothing, so it is ``None`` here too."""
    return None if isinstance(kind, RecurrentState) else kind


def is_state_group(kind: GroupKind) -> bool:
    """Whether a group of this kind holds a recurrent state (``RecurrentState``)."""
    return isinstance(kind, RecurrentState)


def is_checkpoint_at(interval: int, computed_tokens: int) -> bool:
    """Whether a state group of this checkpoint ``interval`` checkpoints a request whose
    first ``computed_tokens`` (L0) are computed: L0 a positive multiple of the interval."""
    return computed_tokens > 0 and computed_tokens % interval == 0


def blocks_for_group(block_size: int, token_count: int, kind: GroupKind) -> int:
    """The blocks a new table of ``token_count`` tokens takes in a group of ``kind``: one in
    a state group, ceil(token_count / block_size) in an attention group."""
    if isinstance(kind, RecurrentState):
        return 1
    return -(-token_count // block_size)
