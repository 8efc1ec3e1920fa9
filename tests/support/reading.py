"""What a scenario test reads of a manager (impl's or the spec-backed one) between its
operations: the queues, a table, a ref count, all through ``to_spec()``.

The operations are the table's (``spec.api``); these only read, so a scenario asserts
literal block ids and queue orders the same way on both managers.
"""

from typing import Protocol

import spec


class Readable(Protocol):
    def to_spec(self) -> spec.AllocatorState: ...


def free_ids(pool: Readable) -> tuple[int, ...]:
    """The free queue, head first."""
    return pool.to_spec().free_block_ids


def cached_free_ids(pool: Readable) -> tuple[int, ...]:
    """The cached free queue, least recently freed first."""
    return pool.to_spec().cached_free_block_ids


def table(pool: Readable, request_id: str, group: int = 0) -> spec.RequestBlockTable:
    """The request's table in ``group``."""
    return spec.snapshot_request(pool.to_spec(), request_id, group)


def ref_count(pool: Readable, block_id: int) -> int:
    """How many tables hold ``block_id``."""
    return pool.to_spec().ref_counts.get(block_id, 0)


def is_swapped(pool: Readable, request_id: str) -> bool:
    """Whether the request is swapped out to the host tier."""
    return request_id in pool.to_spec().host.swapped


class Appended(Protocol):
    @property
    def cached_tokens(self) -> int: ...
    def table(self, group: int = 0) -> spec.RequestBlockTable: ...


def admitted(appended: Appended) -> tuple[spec.RequestBlockTable, int]:
    """An ``allocate``'s group 0 table and how many of its tokens were cached."""
    return appended.table(), appended.cached_tokens
