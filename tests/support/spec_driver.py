"""The spec behind the impl's method names, so one scenario can run on both.

Each call replaces ``self.state`` with the pure function's result; nothing here decides
anything, it only threads state through ``spec``.
"""

from collections.abc import Sequence

import spec
from spec import AllocatorState, KVBlockUsage, PromptAllocation, RequestBlockTable


class SpecDriver:
    """A mutable handle on an immutable spec state, shaped like ``impl.KVBlockManager``."""

    def __init__(self, total_blocks: int, block_size: int = 16) -> None:
        self.state: AllocatorState = spec.init(total_blocks, block_size)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        return self.state.free_block_ids

    @property
    def cached_free_block_ids(self) -> tuple[int, ...]:
        return self.state.cached_free_block_ids

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        self.state = spec.allocate(self.state, request_id, token_count)
        return spec.block_table(self.state, request_id)

    def allocate_prompt(self, request_id: str, token_ids: Sequence[int]) -> PromptAllocation:
        hits = spec.cached_prefix_blocks(self.state, tuple(token_ids))
        self.state = spec.allocate_prompt(self.state, request_id, tuple(token_ids))
        table = spec.block_table(self.state, request_id)
        return PromptAllocation(table, len(hits) * self.state.block_size)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        self.state = spec.append_tokens(self.state, request_id, token_count)
        return spec.block_table(self.state, request_id)

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> RequestBlockTable:
        self.state = spec.append_token_ids(self.state, request_id, tuple(token_ids))
        return spec.block_table(self.state, request_id)

    def fork(self, parent_id: str, child_id: str) -> RequestBlockTable:
        self.state = spec.fork(self.state, parent_id, child_id)
        return spec.block_table(self.state, child_id)

    def release(self, request_id: str) -> list[int]:
        released = list(spec.block_table(self.state, request_id).block_ids)
        self.state = spec.release(self.state, request_id)
        return released

    def preempt(self, request_id: str) -> list[int]:
        released = list(spec.block_table(self.state, request_id).block_ids)
        self.state = spec.preempt(self.state, request_id)
        return released

    def take_copies(self) -> list[tuple[int, int]]:
        copies = list(self.state.pending_copies)
        self.state = spec.take_copies(self.state)
        return copies

    def snapshot_request(self, request_id: str) -> RequestBlockTable:
        return spec.block_table(self.state, request_id)

    def usage(self) -> KVBlockUsage:
        return spec.usage(self.state)
