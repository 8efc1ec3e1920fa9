"""The records impl hands out, shaped as in the article series: a table is a mutable
dataclass with a ``list`` of block ids and defaults, so code written against the article
runs unchanged.

A returned table is a snapshot: changing it never changes the manager. The spec keeps
frozen, hashable twins of these (``spec.RequestBlockTable``, ``spec.PromptAllocation``);
``KVBlock``, ``ReleasedBlocks`` and ``KVBlockUsage`` are the spec's own classes.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestBlockTable:
    """A request's block table (in one KV cache group): its blocks in token order and the
    tokens they hold. ``block_ids[i]`` holds block index ``skipped_blocks + i``: a sliding
    window released the first ``skipped_blocks`` (always 0 with full attention)."""

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    token_count: int = 0
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PromptAllocation:
    """What ``allocate_prompt`` gives: the new table and how many prompt tokens hit the cache.

    The first ``cached_tokens`` tokens' K/V are already in the pool; the engine computes
    only the rest.
    """

    table: RequestBlockTable
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class AppendedSlots:
    """What a step needs of one request, in every KV cache group at once: ``tables[g]`` is
    a snapshot of its table in group g after the call, ``slots[g][i]`` the pool slot the
    i-th new token's K/V goes to in group g. The twin of ``spec.AppendedSlots``."""

    tables: tuple[RequestBlockTable, ...]
    slots: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class SwapCopies:
    """What ``take_swap_copies`` hands over: ``device_to_host`` (device block, host block)
    and ``host_to_device`` (host block, device block) copies in the order they were made.
    The KV pool makes every copy out first, then ``take_copies``' copy-on-write ones,
    then every copy in, then runs the forward. The twin of ``spec.SwapCopies``."""

    device_to_host: list[tuple[int, int]]
    host_to_device: list[tuple[int, int]]
