"""The paged pool's addressing (literal slots), poisoning, and the contiguous twin."""

import torch

from harness.kv_layout import KVLayout, kv_cache_groups
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from harness.runtime.kv_store import KVPlan, KVStore
from impl import AppendedSlots
from spec import FullAttention, RequestBlockTable, SlidingWindow

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu")
)


def _rows(count: int, start: float) -> torch.Tensor:
    # [count, num_kv_heads, head_dim], row r filled with start + r
    return (torch.arange(count, dtype=torch.float32) + start)[:, None, None].expand(count, 2, 3)


def _plan(
    store: KVStore, request_id: str, block_ids: tuple[int, ...], token_count: int, slots: list[int]
) -> KVPlan:
    return store.plan([_step(request_id, block_ids, token_count, slots)])


def _step(
    request_id: str, block_ids: tuple[int, ...], token_count: int, slots: list[int]
) -> AppendedSlots:
    """What an append of one group gives: the table and the new tokens' slots."""
    return AppendedSlots(request_id, token_count, (block_ids,), (0,), (tuple(slots),))


def _rows_of(sdpa_layout: torch.Tensor) -> torch.Tensor:
    # [1, num_kv_heads, tokens, head_dim] -> [tokens, num_kv_heads, head_dim]
    assert sdpa_layout.shape[0] == 1
    return sdpa_layout[0].transpose(0, 1)


def _read_one(store: KVStore, layer_idx: int, plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]:
    ((keys, values),) = store.read(layer_idx, plan)
    return _rows_of(keys), _rows_of(values)


def test_a_token_lands_in_its_block_at_its_offset() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2)
    # A table (3, 1): tokens 0, 1 in block 3; token 2 in block 1, offset 0.
    plan = _plan(pool, "a", (3, 1), 3, [6, 7, 2])
    assert plan.write_index.tolist() == [6, 7, 2]
    assert plan.read_index.tolist() == [3, 1]
    pool.write(1, plan, _rows(3, 10.0), _rows(3, 20.0))
    assert pool.keys[1][3, 0, 0, 0] == 10.0
    assert pool.keys[1][3, 1, 0, 0] == 11.0
    assert pool.keys[1][1, 0, 0, 0] == 12.0
    assert pool.values[1][1, 0, 1, 2] == 22.0
    assert not pool.keys[0].any()  # another layer untouched
    keys, values = _read_one(pool, 1, plan)
    assert torch.equal(keys, _rows(3, 10.0))
    assert torch.equal(values, _rows(3, 20.0))


def test_one_step_writes_and_reads_every_request_through_its_own_table() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2)
    # "a" holds block 2 then 0 (3 tokens, its last one new); "b" holds block 3 (2 new tokens).
    pool.write(0, _plan(pool, "a", (2,), 2, [4, 5]), _rows(2, 1.0), _rows(2, 5.0))
    plan = pool.plan([_step("a", (2, 0), 3, [0]), _step("b", (3,), 2, [6, 7])])
    assert plan.write_index.tolist() == [0, 6, 7]
    assert plan.read_index.tolist() == [2, 0, 3]
    assert plan.read_starts == (0, 4)
    pool.write(0, plan, _rows(3, 3.0), _rows(3, 7.0))
    a_keys, a_values, b_keys, b_values = (_rows_of(t) for read in pool.read(0, plan) for t in read)
    assert a_keys[:, 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert a_values[:, 1, 2].tolist() == [5.0, 6.0, 7.0]
    assert b_keys[:, 0, 0].tolist() == [4.0, 5.0]
    assert b_values[:, 0, 0].tolist() == [8.0, 9.0]


def test_the_pool_size_counts_k_and_v_of_every_layer() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2)
    assert LAYOUT.bytes_per_token == 2 * 2 * 2 * 3 * 4
    assert pool.nbytes == 8 * LAYOUT.bytes_per_token


def test_a_poisoned_pool_fills_exactly_the_released_blocks_with_nan() -> None:
    pool = PoisonedKVPool(LAYOUT, total_blocks=4, block_size=2)
    pool.release("a", [2, 0])
    for tensor in (*pool.keys, *pool.values):
        assert tensor[[0, 2]].isnan().all()
        assert not tensor[[1, 3]].isnan().any()


def test_a_plain_pool_leaves_released_blocks_as_they_were() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2)
    pool.release("a", [2, 0])
    assert not any(tensor.isnan().any() for tensor in pool.keys)


def test_contiguous_buffers_store_by_position_and_ignore_block_ids() -> None:
    buffers = ContiguousKVBuffers(LAYOUT, max_tokens=8)
    first = _plan(buffers, "a", (3, 1), 2, [6, 7])
    buffers.write(0, first, _rows(2, 1.0), _rows(2, 5.0))
    second = _plan(buffers, "a", (3, 1), 3, [2])
    assert second.write_index.tolist() == [2]
    buffers.write(0, second, _rows(1, 3.0), _rows(1, 7.0))
    keys, values = _read_one(buffers, 0, second)
    assert keys[:, 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert values[:, 0, 0].tolist() == [5.0, 6.0, 7.0]


def test_copy_on_write_copies_a_block_in_every_layer_and_nothing_else() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2)
    for layer in range(2):
        # Block 1 holds rows 10, 11 (keys) and 20, 21 (values) in every layer.
        pool.write(layer, _plan(pool, "a", (1,), 2, [2, 3]), _rows(2, 10.0), _rows(2, 20.0))
    pool.copy_blocks([(1, 3)])
    for layer in range(2):
        assert torch.equal(pool.keys[layer][3], _rows(2, 10.0))
        assert torch.equal(pool.values[layer][3], _rows(2, 20.0))
        assert torch.equal(pool.keys[layer][1], _rows(2, 10.0))  # the source stays
        assert not pool.keys[layer][0].any() and not pool.keys[layer][2].any()


def test_a_forked_contiguous_buffer_is_a_copy_the_parent_does_not_see() -> None:
    buffers = ContiguousKVBuffers(LAYOUT, max_tokens=4)
    parent = _plan(buffers, "p", (), 2, [0, 1])
    buffers.write(0, parent, _rows(2, 10.0), _rows(2, 20.0))
    buffers.fork("p", "c")
    child = _plan(buffers, "c", (), 3, [2])
    buffers.write(0, child, _rows(1, 99.0), _rows(1, 99.0))
    child_keys, _ = _read_one(buffers, 0, child)
    assert child_keys[:, 0, 0].tolist() == [10.0, 11.0, 99.0]
    parent_grown = _plan(buffers, "p", (), 3, [2])
    parent_keys, _ = _read_one(buffers, 0, parent_grown)
    assert parent_keys[2, 0, 0] == 0.0  # the child's write went to its own buffer


def test_contiguous_buffers_read_as_pages_give_each_request_a_run_of_its_own_pages() -> None:
    buffers = ContiguousKVBuffers(LAYOUT, max_tokens=5, block_size=2)  # rows of 6 tokens
    for request_id, start in (("a", 10.0), ("b", 20.0), ("c", 30.0)):  # the rows grow 1, 2, 4
        plan = _plan(buffers, request_id, (), 5, [0, 0, 0, 0, 0])
        buffers.write(1, plan, _rows(5, start), _rows(5, start))
    tables = {r: RequestBlockTable(r, (), 5) for r in "abc"}
    assert [buffers.block_ids_of(tables[r]) for r in "abc"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    keys, _ = buffers.pages(1)  # [4 rows * 3 pages, 2, 2, 3]
    assert keys.shape == (12, 2, 2, 3)
    assert keys[3:6].flatten(0, 1)[:5, 0, 0].tolist() == [20.0, 21.0, 22.0, 23.0, 24.0]
    buffers.release("a", [])
    plan = _plan(buffers, "d", (), 1, [0])  # takes a's row back, zeroed
    assert buffers.block_ids_of(RequestBlockTable("d", (), 1)) == [0]
    assert not buffers.pages(1)[0][0:3].any()


# -- KV cache groups (sliding windows) -----------------------------------------------


def test_kv_cache_groups_put_full_layers_first_in_groups_of_equal_size() -> None:
    assert kv_cache_groups((), 3) == ((None, (0, 1, 2)),)
    assert kv_cache_groups((7, 7), 2) == ((7, (0, 1)),)
    assert kv_cache_groups((8, None), 2) == ((None, (1,)), (8, (0,)))
    # Gemma 3's 5:1: one full group and five windowed ones of one layer each.
    gemma3 = (6, 6, 6, 6, 6, None)
    assert kv_cache_groups(gemma3, 6) == (
        (None, (5,)),
        (6, (0,)),
        (6, (1,)),
        (6, (2,)),
        (6, (3,)),
        (6, (4,)),
    )
    # Two full layers, three windowed: groups of two, the last windowed one smaller.
    assert kv_cache_groups((4, None, 4, None, 4), 5) == ((None, (1, 3)), (4, (0, 2)), (4, (4,)))


GROUPED = KVLayout(2, 2, 3, torch.float32, torch.device("cpu"), layer_windows=(5, None))


def test_a_grouped_pool_shares_one_tensor_between_the_groups_layers() -> None:
    pool = PagedKVPool(GROUPED, total_blocks=4, block_size=2)
    assert GROUPED.group_windows == (FullAttention(), SlidingWindow(5))
    assert len(pool.keys) == 1  # layer 1 (full) and layer 0 (window) share it
    assert pool.nbytes == 4 * 2 * GROUPED.bytes_per_token // 2


def test_each_layer_writes_and_reads_through_its_groups_table() -> None:
    pool = PagedKVPool(GROUPED, total_blocks=6, block_size=2)
    # Five tokens; the full group (layer 1) holds blocks (0, 1, 2); the windowed group
    # (layer 0) skipped its first block and holds (4, 5): positions 2 .. 4.
    # Position 4: block 2, offset 0 in the full group; block 5, offset 0 in the windowed.
    step = AppendedSlots("a", 5, ((0, 1, 2), (4, 5)), (0, 1), ((4,), (10,)))
    plan = pool.plan([step])
    assert plan.groups[0].write_index.tolist() == [4]  # block 2, offset 0
    assert plan.groups[1].write_index.tolist() == [10]  # position 4: block 5, offset 0
    assert (pool.first_positions(1, plan), pool.first_positions(0, plan)) == ((0,), (2,))
    pool.write(0, plan, _rows(1, 40.0), _rows(1, 50.0))
    pool.write(1, plan, _rows(1, 10.0), _rows(1, 20.0))
    assert pool.keys[0][5, 0, 0, 0] == 40.0 and pool.keys[0][2, 0, 0, 0] == 10.0
    keys, _ = _read_one(pool, 0, plan)
    assert keys.shape[0] == 3  # positions 2, 3, 4
    assert keys[2, 0, 0] == 40.0
    keys, _ = _read_one(pool, 1, plan)
    assert keys.shape[0] == 5 and keys[4, 0, 0] == 10.0


def test_a_poisoned_pool_poisons_blocks_a_window_released() -> None:
    pool = PoisonedKVPool(GROUPED, total_blocks=4, block_size=2)
    pool.release_skipped([3])
    assert pool.keys[0][3].isnan().all() and not pool.keys[0][2].isnan().any()
