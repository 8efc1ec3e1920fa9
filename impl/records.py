"""The records impl hands out where spec's frozen dataclasses would not do: the article's
mutable table, and a step's slots built fast.

A returned table is a snapshot: changing it never changes the manager. ``KVBlock``,
``ReleasedBlocks``, ``Transfers`` and ``KVBlockUsage`` are the spec's own classes.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

import spec


@dataclass(slots=True)
class RequestBlockTable:
    """A request's block table (in one KV cache group), shaped as in the article series: a
    mutable dataclass with a ``list`` of block ids and defaults, so code written against the
    article runs unchanged. ``block_ids[i]`` holds block index ``skipped_blocks + i``: a
    sliding window released the first ``skipped_blocks`` (always 0 with full attention)."""

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    token_count: int = 0
    skipped_blocks: int = 0


class AppendedSlots(NamedTuple):
    """What ``allocate`` and ``append`` give: the twin of ``spec.AppendedSlots`` (its
    fields and ``table``), immutable too.

    NOTE: a named tuple, not a frozen dataclass: a frozen dataclass sets each field through
    ``object.__setattr__``, which made it the costliest part of a decode append. The block
    ids are the table's own cached tuples (rebuilt only when a group's blocks change), so
    an append that opens no block copies nothing.
    """

    request_id: str
    token_count: int
    block_ids: tuple[tuple[int, ...], ...]
    skipped_blocks: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    cached_tokens: int = 0

    def table(self, group: int = 0) -> spec.RequestBlockTable:
        """The request's table in KV cache group ``group``."""
        return spec.RequestBlockTable(
            self.request_id, self.block_ids[group], self.token_count, self.skipped_blocks[group]
        )
