"""The kinds of KV cache group: what every kind must say (``GroupKind``), and the registry
that turns an entry of ``group_windows`` into its kind (``group_kinds``).

A kind holds each rule in which groups differ: which leading blocks no query reads, how
many blocks a table spans, which keys a prefix hit needs, which blocks a table's tokens
cache, when the running block is checkpointed, when a write copies the block it writes,
whether a table may be rewound, where a position's K/V lives, and the invariants its
groups keep. The transitions (``spec.growth``, ``spec.caching``, ``spec.releasing``) and
``spec.invariants`` ask a group's kind and never which kind it is.

The kinds: ``FullAttention`` and ``SlidingWindow`` (``spec.kinds.attention``) and
``RecurrentState`` (``spec.kinds.recurrent_state``). A new kind is a module here with a
class that has ``GroupKind``'s methods, its entries in ``KINDS`` and ``KIND_EXAMPLES``
(and a shorthand in ``group_kind``, if it has one), its twin in ``impl.group_kinds``, and
its tests.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from spec.kinds.attention import FullAttention, SlidingWindow
from spec.kinds.recurrent_state import RecurrentState
from spec.records import CacheKey, GroupView, RequestBlockTable


class GroupKind(Protocol):
    """The rules of one kind of KV cache group (each documented on the kinds)."""

    @property
    def name(self) -> str: ...

    @property
    def window(self) -> int | None: ...

    def check(self, group: int, block_size: int, host_blocks: int) -> None: ...

    def first_read(self, token_count: int) -> int: ...

    def skipped_blocks_at(self, block_size: int, computed_tokens: int) -> int: ...

    def next_skip_at(self, block_size: int, skipped_blocks: int) -> int | None: ...

    def table_blocks(self, block_size: int, token_count: int) -> int: ...

    def hit_keys(
        self, block_size: int, token_ids: tuple[int, ...], hit_tokens: int, cache_salt: str | None
    ) -> tuple[CacheKey, ...]: ...

    def keyed_block_indices(
        self, block_size: int, first_index: int, skipped_blocks: int, token_count: int
    ) -> range: ...

    def is_checkpoint_at(self, computed_tokens: int) -> bool: ...

    def rewrites_last_block(self, block_size: int, computed_tokens: int) -> bool: ...

    def copies_before_write(self, shared: bool, cached: bool) -> bool: ...

    def check_truncate(
        self, group: int, request_id: str, held_tokens: int, token_count: int
    ) -> None: ...

    def slots(
        self, block_size: int, table: RequestBlockTable, positions: range
    ) -> tuple[int, ...]: ...

    def is_table_sized(self, block_size: int, table: RequestBlockTable) -> bool: ...

    def invariants(self) -> Mapping[str, Callable[[GroupView], bool]]: ...


# What a caller may list in ``group_windows``: a kind, or its shorthand (``None``: full
# attention; an ``int`` W: a sliding window of W tokens).
GroupEntry = GroupKind | int | None

KINDS = (FullAttention, SlidingWindow, RecurrentState)
# One of each kind, for what does not depend on its parameters (its invariants' names).
KIND_EXAMPLES: tuple[GroupKind, ...] = (FullAttention(), SlidingWindow(1), RecurrentState(1))


def copies_hit(kind: GroupKind, block_size: int, hit_tokens: int) -> bool:
    """Whether an admission with a hit of ``hit_tokens`` tokens copies the hit's last block
    into a fresh one: the prompt past the hit writes into that cached, unshared block, and
    ``kind`` copies such a block before a write (a state group's checkpoint)."""
    return kind.rewrites_last_block(block_size, hit_tokens) and kind.copies_before_write(
        shared=False, cached=True
    )


def kind_names(kinds: Sequence[GroupKind]) -> str:
    """``kinds`` by their names, for a message: ``[full attention, window 8]``."""
    return f"[{', '.join(kind.name for kind in kinds)}]"


def group_kind(group: int, entry: object) -> GroupKind:
    """The kind ``entry`` names for ``group``: ``None`` is ``FullAttention()``, an ``int``
    W is ``SlidingWindow(W)``, a kind is itself (TypeError for anything else, ``bool``
    too); its own parameters are its ``check``'s."""
    if entry is None:
        return FullAttention()
    if type(entry) is int:
        return SlidingWindow(entry)
    if type(entry) in KINDS:
        assert isinstance(entry, KINDS)  # narrowed for mypy
        return entry
    raise TypeError(
        f"window of group {group} must be None, an int or a "
        f"{', '.join(kind.__name__ for kind in KINDS[:-1])} or {KINDS[-1].__name__}, "
        f"got {type(entry).__name__} {entry!r}"
    )


def group_kinds(group_windows: object, block_size: int, host_blocks: int) -> tuple[GroupKind, ...]:
    """Refuse KV cache groups that cannot be served in a pool of ``block_size`` with
    ``host_blocks`` host blocks; return their kinds.

    A tuple or list (TypeError), not empty (ValueError), each entry as ``group_kind``
    says, then as its kind's ``check`` says (a window of at least 1 token; a state
    group's interval a positive multiple of ``block_size``, and no host tier beside it).
    """
    if not isinstance(group_windows, tuple | list):
        raise TypeError(
            f"group_windows must be a tuple, got {type(group_windows).__name__} {group_windows!r}"
        )
    if not group_windows:
        raise ValueError("group_windows must name at least 1 KV cache group, got 0")
    kinds: list[GroupKind] = []
    for group, entry in enumerate(group_windows):
        kinds.append(group_kind(group, entry))
        kinds[-1].check(group, block_size, host_blocks)
    return tuple(kinds)


__all__ = [
    "KINDS",
    "KIND_EXAMPLES",
    "FullAttention",
    "GroupEntry",
    "GroupKind",
    "RecurrentState",
    "SlidingWindow",
    "copies_hit",
    "group_kind",
    "group_kinds",
    "kind_names",
]
