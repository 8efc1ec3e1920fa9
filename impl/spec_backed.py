"""``SpecBackedManager``: ``KVBlockManager``'s API with the spec behind it, for tests and
the spec row of the allocator benchmark; not part of ``impl``'s public API (import it from
``impl.spec_backed``). ``as_article`` is the one place spec's records map onto impl's.

Each method threads an immutable spec state through ``spec.api``'s function of the same
name and hands back the records impl hands out; it decides nothing itself. So a scenario
written against the manager runs on the spec unchanged, and the spec-side benchmark
times exactly what the specification does. Slow on purpose: O(pool) per call.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import spec
from impl.records import AppendedSlots, PromptAllocation, RequestBlockTable, SwapCopies
from spec import AllocatorState, KVBlockUsage, ReleasedBlocks, SwappedOut
from spec import init as spec_init
from spec.api import OPERATIONS


def as_article(value: object) -> object:
    """``value`` with spec tables (and prompt allocations) turned into these records; any
    other value as it is. The one place the tests map spec results onto impl's."""
    if isinstance(value, spec.RequestBlockTable):
        return RequestBlockTable(
            value.request_id, list(value.block_ids), value.token_count, value.skipped_blocks
        )
    if isinstance(value, spec.AppendedSlots):
        tables = tuple(as_article(table) for table in value.tables)
        return AppendedSlots(tables, value.slots)  # type: ignore[arg-type]
    if isinstance(value, tuple) and value and isinstance(value[0], spec.RequestBlockTable):
        return tuple(as_article(table) for table in value)
    if isinstance(value, spec.SwapCopies):
        return SwapCopies(list(value.device_to_host), list(value.host_to_device))
    if isinstance(value, spec.PromptAllocation):
        table = as_article(value.table)
        assert isinstance(table, RequestBlockTable)
        return PromptAllocation(table, value.cached_tokens)
    return value


class SpecBackedManager:
    """A mutable handle on a spec state, shaped like ``impl.KVBlockManager``."""

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        *,
        group_windows: tuple[int | None, ...] = (None,),
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
    ) -> None:
        self.state: AllocatorState = spec_init(
            total_blocks, block_size, group_windows, host_blocks, host_prefix_cache
        )

    def call(self, name: str, *args: object) -> Any:  # Any: the method's own return type
        """Apply the API call ``name`` to the state; return its result as impl would."""
        self.state, result = OPERATIONS[name](self.state, *args)
        return as_article(result)

    @property
    def total_blocks(self) -> int:
        return self.state.total_blocks

    @property
    def block_size(self) -> int:
        return self.state.block_size

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return self.state.group_windows

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        return self.state.free_block_ids

    @property
    def cached_free_block_ids(self) -> tuple[int, ...]:
        return self.state.cached_free_block_ids

    @property
    def free_blocks(self) -> int:
        return len(self.state.free_block_ids) + len(self.state.cached_free_block_ids)

    @property
    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        return self.state.pending_copies

    @property
    def request_tables(self) -> Mapping[str, RequestBlockTable]:
        return {request_id: self.snapshot_request(request_id) for request_id in self.state.tables}

    def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
        result: RequestBlockTable = self.call("allocate", request_id, token_count)
        return result

    def allocate_prompt(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> PromptAllocation:
        result: PromptAllocation = self.call("allocate_prompt", request_id, token_ids, cache_salt)
        return result

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        result: RequestBlockTable = self.call("append_tokens", request_id, token_count)
        return result

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> RequestBlockTable:
        result: RequestBlockTable = self.call("append_token_ids", request_id, token_ids)
        return result

    def append_slot(self, request_id: str) -> int:
        result: int = self.call("append_slot", request_id)
        return result

    def append_token_slot(self, request_id: str, token_id: int) -> int:
        result: int = self.call("append_token_slot", request_id, token_id)
        return result

    def fork(self, parent_id: str, child_id: str) -> RequestBlockTable:
        result: RequestBlockTable = self.call("fork", parent_id, child_id)
        return result

    def truncate(self, request_id: str, token_count: int) -> RequestBlockTable:
        result: RequestBlockTable = self.call("truncate", request_id, token_count)
        return result

    def truncate_blocks(self, request_id: str, token_count: int) -> ReleasedBlocks:
        result: ReleasedBlocks = self.call("truncate_blocks", request_id, token_count)
        return result

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        result: int = self.call("cached_prefix_tokens", token_ids, cache_salt)
        return result

    def release(self, request_id: str) -> list[int]:
        result: list[int] = self.call("release", request_id)
        return result

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        result: ReleasedBlocks = self.call("release_blocks", request_id)
        return result

    def preempt(self, request_id: str) -> ReleasedBlocks:
        result: ReleasedBlocks = self.call("preempt", request_id)
        return result

    def reset_prefix_cache(self) -> int:
        result: int = self.call("reset_prefix_cache")
        return result

    def take_copies(self) -> list[tuple[int, int]]:
        result: list[tuple[int, int]] = self.call("take_copies")
        return result

    def take_skipped_blocks(self) -> list[int]:
        result: list[int] = self.call("take_skipped_blocks")
        return result

    def snapshot_request(self, request_id: str, group: int = 0) -> RequestBlockTable:
        result: RequestBlockTable = self.call("snapshot_request", request_id, group)
        return result

    def snapshot_groups(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        result: tuple[RequestBlockTable, ...] = self.call("snapshot_groups", request_id)
        return result

    def new_token_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        result: AppendedSlots = self.call("new_token_slots", request_id, token_count)
        return result

    def append_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        result: AppendedSlots = self.call("append_slots", request_id, token_count)
        return result

    def append_token_id_slots(self, request_id: str, token_ids: Sequence[int]) -> AppendedSlots:
        result: AppendedSlots = self.call("append_token_id_slots", request_id, token_ids)
        return result

    def can_allocate(self, token_count: int) -> bool:
        result: bool = self.call("can_allocate", token_count)
        return result

    def ref_count(self, block_id: int) -> int:
        result: int = self.call("ref_count", block_id)
        return result

    def usage(self) -> KVBlockUsage:
        result: KVBlockUsage = self.call("usage")
        return result

    def swap_out(self, request_id: str) -> SwappedOut:
        result: SwappedOut = self.call("swap_out", request_id)
        return result

    def swap_in(self, request_id: str) -> tuple[RequestBlockTable, ...]:
        result: tuple[RequestBlockTable, ...] = self.call("swap_in", request_id)
        return result

    def take_swap_copies(self) -> SwapCopies:
        result: SwapCopies = self.call("take_swap_copies")
        return result

    def is_swapped(self, request_id: str) -> bool:
        result: bool = self.call("is_swapped", request_id)
        return result

    def can_swap_in(self, request_id: str) -> bool:
        result: bool = self.call("can_swap_in", request_id)
        return result
