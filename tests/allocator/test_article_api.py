"""Code written the article series' way runs on impl unchanged: its records, its examples,
a ``__post_init__`` subclass, a mock patch, and matching on its error messages.

Where pagedkv deliberately differs (release frees the last block first, so block ids after
a release differ), the README's "Differences from the article" says so; nothing here
depends on that order.
"""

from collections.abc import Callable
from unittest import mock

import pytest

from impl import BlockAllocationError, KVBlock, KVBlockManager, RequestBlockTable


def test_a_table_is_a_list_of_block_ids_with_the_articles_defaults() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    assert manager.allocate("req-a", 5).block_ids == [0, 1]
    empty = RequestBlockTable("req-b")
    assert (empty.block_ids, empty.token_count) == ([], 0)
    assert RequestBlockTable("req-c") is not empty and RequestBlockTable("req-c").block_ids == []


def test_a_returned_table_is_a_snapshot_that_never_changes_the_manager() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    table = manager.allocate("req-a", 5)
    table.block_ids.append(3)
    table.token_count = 99
    manager.request_tables["req-a"].block_ids.clear()
    assert manager.snapshot_request("req-a") == RequestBlockTable("req-a", [0, 1], 5)
    assert manager.usage().free_blocks == 2


def test_the_articles_walkthrough_allocates_appends_and_releases() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    assert manager.allocate("req-a", 5) == RequestBlockTable("req-a", [0, 1], 5)
    assert manager.usage().internal_fragmentation_tokens == 3
    assert manager.append_tokens("req-a", 3) == RequestBlockTable("req-a", [0, 1], 8)
    assert manager.append_tokens("req-a", 1) == RequestBlockTable("req-a", [0, 1, 2], 9)
    assert manager.release("req-a") == [0, 1, 2]
    usage = manager.usage()
    assert (usage.used_blocks, usage.free_blocks) == (0, 4)
    assert manager.blocks[3] == KVBlock(block_id=3, capacity_tokens=4)
    assert len(manager.blocks) == 4


def test_a_subclass_extends_the_manager_the_dataclass_way() -> None:
    class TrackingManager(KVBlockManager):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.events: list[tuple[str, str, int]] = []

        def allocate(self, request_id: str, token_count: int) -> RequestBlockTable:
            table = super().allocate(request_id, token_count)
            self.events.append(("allocate", request_id, self.usage().used_blocks))
            return table

        def release(self, request_id: str) -> list[int]:
            released = super().release(request_id)
            self.events.append(("release", request_id, self.usage().used_blocks))
            return released

    manager = TrackingManager(total_blocks=4, block_size=2)
    manager.allocate("req-a", 3)
    manager.release("req-a")
    assert manager.events == [("allocate", "req-a", 2), ("release", "req-a", 0)]
    assert (manager.total_blocks, manager.block_size) == (4, 2)


def test_an_instance_method_can_be_patched_with_mock() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    with mock.patch.object(manager, "allocate", wraps=manager.allocate) as spy:
        manager.allocate("req-a", 5)
    spy.assert_called_once_with("req-a", 5)
    assert manager.snapshot_request("req-a").block_ids == [0, 1]


def test_request_tables_reads_like_the_articles_dict_and_refuses_writes() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    manager.allocate("req-a", 5)
    assert list(manager.request_tables) == ["req-a"]
    assert "req-a" in manager.request_tables and len(manager.request_tables) == 1
    assert manager.request_tables["req-a"] == RequestBlockTable("req-a", [0, 1], 5)
    read_only = r"^request_tables is read-only: use allocate, append_tokens or release$"
    with pytest.raises(TypeError, match=read_only):
        manager.request_tables["req-b"] = RequestBlockTable("req-b")  # type: ignore[index]
    with pytest.raises(TypeError, match=read_only):
        del manager.request_tables["req-a"]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        manager.request_tables = {}  # type: ignore[misc]
    assert manager.usage().request_count == 1
    assert repr(manager.request_tables) == (
        "request_tables({'req-a': RequestBlockTable(request_id='req-a', block_ids=[0, 1], "
        "token_count=5, skipped_blocks=0)})"
    )


def test_blocks_slice_like_a_list_of_the_pools_records() -> None:
    manager = KVBlockManager(total_blocks=4, block_size=4)
    assert manager.blocks[1:3] == [KVBlock(1, 4), KVBlock(2, 4)]
    assert manager.blocks[::-2] == [KVBlock(3, 4), KVBlock(1, 4)]
    assert manager.blocks[-1] == KVBlock(3, 4) and manager.blocks[5:] == []
    with pytest.raises(IndexError):
        manager.blocks[4]


def test_the_articles_error_constructs_from_a_message() -> None:
    error = BlockAllocationError("not enough free KV blocks: needed=2 free=1")
    assert isinstance(error, RuntimeError)
    assert error.args == ("not enough free KV blocks: needed=2 free=1",)


@pytest.mark.parametrize(
    ("call", "error", "articles_words"),
    [
        (lambda m: m.allocate("req-b", 9), BlockAllocationError, "not enough free KV blocks"),
        (lambda m: m.allocate("req-a", 1), ValueError, "request already has allocated blocks"),
        (lambda m: m.allocate("req-b", -1), ValueError, "token_count must be non-negative"),
        (lambda m: m.append_tokens("req-a", -1), ValueError, "token_count must be non-negative"),
        (lambda m: m.append_tokens("nope", 1), KeyError, "request has no allocated blocks: nope"),
        (lambda m: m.release("nope"), KeyError, "request has no allocated blocks: nope"),
        (lambda m: m.append_slot("nope"), KeyError, "request has no allocated blocks: nope"),
        (lambda m: m.snapshot_request("nope"), KeyError, "request has no allocated blocks: nope"),
    ],
)
def test_errors_start_with_the_articles_wording(
    call: Callable[[KVBlockManager], object], error: type[Exception], articles_words: str
) -> None:
    manager = KVBlockManager(total_blocks=2, block_size=4)
    manager.allocate("req-a", 4)
    before = (manager.free_block_ids, manager.snapshot_request("req-a"), manager.usage())
    with pytest.raises(error, match=articles_words):
        call(manager)
    assert (manager.free_block_ids, manager.snapshot_request("req-a"), manager.usage()) == before


def test_out_of_blocks_keeps_the_numbers_on_the_error() -> None:
    manager = KVBlockManager(total_blocks=2, block_size=4)
    manager.allocate("req-a", 4)
    with pytest.raises(BlockAllocationError) as refused:
        manager.allocate("req-b", 9)
    assert str(refused.value) == "not enough free KV blocks: needed=3 free=1 (request 'req-b')"
    assert (refused.value.request_id, refused.value.needed_blocks) == ("req-b", 3)
    assert refused.value.free_blocks == 1


@pytest.mark.parametrize(
    ("total_blocks", "block_size", "message"),
    [
        (0, 16, "total_blocks must be at least 1, got 0"),
        (4, 0, "block_size must be at least 1, got 0"),
    ],
)
def test_a_pool_below_one_block_is_refused_in_the_articles_words(
    total_blocks: int, block_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        KVBlockManager(total_blocks=total_blocks, block_size=block_size)
