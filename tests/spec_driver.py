"""The spec behind the impl's method names, so one scenario can run on both.

Each call replaces ``self.state`` with the pure function's result; nothing here decides
anything, it only threads state through ``spec``.
"""

import spec
from spec import AllocatorState, KVBlockUsage, RequestBlockTable


class SpecDriver:
    """A mutable handle on an immutable spec state, shaped like ``impl.KVBlockManager``."""

    def __init__(self, total_blocks: int, block_size: int = 16) -> None:
        self.state: AllocatorState = spec.init(total_blocks, block_size)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        return self.state.free_block_ids

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        self.state = spec.allocate(self.state, request_id, token_count)
        return spec.block_table(self.state, request_id)

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        self.state = spec.append_tokens(self.state, request_id, token_count)
        return spec.block_table(self.state, request_id)

    def release(self, request_id: str) -> list[int]:
        released = list(spec.block_table(self.state, request_id).block_ids)
        self.state = spec.release(self.state, request_id)
        return released

    def snapshot_request(self, request_id: str) -> RequestBlockTable:
        return spec.block_table(self.state, request_id)

    def usage(self) -> KVBlockUsage:
        return spec.usage(self.state)
