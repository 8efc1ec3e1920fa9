"""pagedkv's own allocator as a conformance target, in exact mode: its block order is the
spec's, so the kit compares block ids and queue order, not only what any order must keep.

``PagedKVAdapter`` wraps ``impl.KVCacheManager`` or any subclass of it (a user's extension,
or a planted bug in the tests).
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from harness.conformance.adapter import CACHE_SALT, OPERATION_NAMES, Observation, TargetTable
from impl import KVCacheManager


class PagedKVAdapter:
    """``KVCacheManager`` (or ``manager_class``) seen through the spec's operations."""

    exact = True
    supports = frozenset({*OPERATION_NAMES, CACHE_SALT})
    differences: Mapping[str, str] = MappingProxyType({})

    def __init__(
        self,
        total_blocks: int = 12,
        block_size: int = 4,
        group_windows: tuple[int | None, ...] = (None,),
        manager_class: type[KVCacheManager] = KVCacheManager,
    ) -> None:
        self.manager = manager_class(total_blocks, block_size, group_windows=group_windows)
        self.name = f"pagedkv {manager_class.__name__} windows={list(group_windows)}"

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return self.manager.group_windows

    @property
    def pool_block_ids(self) -> Sequence[int]:
        return range(self.manager.total_blocks)

    def allocate_prompt(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        return self.manager.allocate(request_id, token_ids, cache_salt).cached_tokens

    def allocate(self, request_id: str, token_count: int) -> None:
        self.manager.allocate(request_id, token_count)

    def append_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        self.manager.append(request_id, token_ids)

    def append_tokens(self, request_id: str, token_count: int) -> None:
        self.manager.append(request_id, token_count)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)

    def release(self, request_id: str) -> None:
        self.manager.release(request_id)

    def preempt(self, request_id: str) -> None:
        self.manager.preempt(request_id)

    def truncate(self, request_id: str, token_count: int) -> None:
        self.manager.truncate(request_id, token_count)

    def observe(self) -> Observation:
        state = self.manager.to_spec()
        return Observation(
            tables=tuple(
                {
                    request_id: TargetTable(t.block_ids, t.token_count, t.skipped_blocks)
                    for request_id, t in tables.items()
                }
                for tables in state.group_tables
            ),
            free_block_ids=state.free_block_ids,
            cached_free_block_ids=state.cached_free_block_ids,
            cached_block_ids=tuple(frozenset(cache.values()) for cache in state.group_caches),
            ref_counts=dict(state.ref_counts),
        )
