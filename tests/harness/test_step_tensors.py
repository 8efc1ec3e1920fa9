"""The kernels' step metadata against the spec's slot of every token, on tables impl made.

Tables come from ``impl.KVCacheManager`` driven through prompts with shared prefixes
(prefix hits), forks and decode appends into shared blocks (copy-on-write). The property:
``block_table`` addresses, for every key below ``seqused_k``, the slot
``spec.slot_index`` gives; ``seqused_k`` is every token held; padding entries are
``PAD_BLOCK_ID`` and never inside a request's keys; all int32, contiguous, on the device.
Planted bugs (an off-by-one ``seqused_k``, swapped rows) must make it fail.
"""

from collections.abc import Callable, Sequence
from itertools import accumulate

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.runtime import step_tensors
from harness.runtime.step_tensors import PAD_BLOCK_ID, StepTensors, build_step_tensors
from impl import BlockAllocationError, KVCacheManager
from spec import RequestBlockTable, blocks_for_tokens, slot_index

CPU = torch.device("cpu")


def assert_matches_tables(
    tensors: StepTensors,
    tables: Sequence[RequestBlockTable],
    new_token_counts: Sequence[int],
    manager: KVCacheManager,
) -> None:
    """The property: ``tensors`` say exactly what the manager's ``tables`` say."""
    block_size = manager.block_size
    for name in ("block_table", "seqused_k", "cu_seqlens_q", "cu_seqlens_k"):
        tensor = getattr(tensors, name)
        assert tensor.dtype == torch.int32, name
        assert tensor.is_contiguous(), name
        assert tensor.device == CPU, name
    table = tensors.block_table.tolist()
    seqused_k = tensors.seqused_k.tolist()
    assert len(table) == len(seqused_k) == len(tables)
    for row, key_count, request in zip(table, seqused_k, tables, strict=True):
        assert key_count == request.token_count, request.request_id
        used_blocks = blocks_for_tokens(block_size, key_count)
        for position in range(key_count):
            slot = row[position // block_size] * block_size + position % block_size
            assert slot == slot_index(block_size, request.block_ids, position), position
        assert all(0 <= block_id < manager.total_blocks for block_id in row[:used_blocks])
        # padding: never a block, so never inside any key below seqused_k
        assert row[used_blocks:] == [PAD_BLOCK_ID] * (len(row) - used_blocks)
    assert tensors.cu_seqlens_q.tolist() == list(accumulate(new_token_counts, initial=0))
    assert tensors.cu_seqlens_k.tolist() == list(accumulate(seqused_k, initial=0))
    assert tensors.max_q == max(new_token_counts)
    assert tensors.max_k == max(table.token_count for table in tables)


def build(
    tables: Sequence[RequestBlockTable], new_token_counts: Sequence[int], block_size: int
) -> StepTensors:
    """The step tensors of ``tables`` as the paged pool builds them (its block ids)."""
    return build_step_tensors(
        [table.block_ids for table in tables],
        [table.token_count for table in tables],
        new_token_counts,
        block_size,
        CPU,
    )


# One operation on the manager: (kind, request index, prompt length or prefix source)
Operation = tuple[str, int, int]

OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["prompt", "prompt", "append", "append", "fork", "release"]),
        st.integers(0, 5),
        st.integers(1, 20),
    ),
    min_size=1,
    max_size=25,
)


def drive(operations: Sequence[Operation], block_size: int) -> KVCacheManager:
    """A manager after ``operations``: prompts sharing a prefix (so prefix hits), forks,
    decode appends (into shared blocks after a fork: copy-on-write) and releases. An
    operation the pool cannot serve is skipped."""
    manager = KVCacheManager(24, block_size)
    common = tuple(range(100, 100 + 3 * block_size))  # a shared system-prompt prefix
    live: list[str] = []
    for number, (kind, index, size) in enumerate(operations):
        request_id = f"r{number}"
        try:
            if kind == "prompt" or not live:
                manager.allocate(request_id, common[: size % len(common)] + (number,) * size)
                live.append(request_id)
            elif kind == "append":
                manager.append(live[index % len(live)], (number,))
            elif kind == "fork":
                manager.fork(live[index % len(live)], request_id)
                live.append(request_id)
            else:
                manager.release(live.pop(index % len(live)))
        except BlockAllocationError:
            continue
        manager.take_transfers()
    return manager


@settings(max_examples=100)  # ~6 s in CI; the ci profile's 300 cost ~20 s
@given(
    operations=OPERATIONS,
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    data=st.data(),
)
def test_every_key_below_seqused_k_is_addressed_at_the_managers_slot(
    operations: list[Operation], block_size: int, data: st.DataObject
) -> None:
    manager = drive(operations, block_size)
    tables = list(manager.to_spec().tables.values())
    if not tables:
        return
    new_token_counts = [data.draw(st.integers(1, table.token_count)) for table in tables]
    assert_matches_tables(
        build(tables, new_token_counts, block_size), tables, new_token_counts, manager
    )


def scenario() -> tuple[list[RequestBlockTable], list[int], KVCacheManager]:
    """Literal tables: a prefix hit, a fork and a copy-on-write, block size 4."""
    manager = KVCacheManager(12, 4)
    manager.allocate("a", tuple(range(10)))  # 10 tokens: blocks 0, 1, 2
    manager.allocate("b", (*range(8), 50))  # hits a's two full blocks, 9 tokens
    manager.fork("a", "c")
    manager.append("c", [7])  # c's copy of a's shared partly filled last block
    copies = manager.take_transfers().copies
    tables = [manager.tables(r)[0] for r in ("a", "b", "c")]
    assert [table.block_ids for table in tables] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]
    assert copies == ((2, 4),)
    return tables, [1, 1, 2], manager


def test_the_scenario_tables_become_literal_tensors() -> None:
    tables, new_token_counts, manager = scenario()
    tensors = build(tables, new_token_counts, manager.block_size)
    assert tensors.block_table.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert tensors.seqused_k.tolist() == [10, 9, 11]
    assert tensors.cu_seqlens_q.tolist() == [0, 1, 2, 4]
    assert (tensors.max_q, tensors.max_k) == (2, 11)
    assert_matches_tables(tensors, tables, new_token_counts, manager)


def test_short_tables_are_padded_with_the_pad_block_id() -> None:
    manager = KVCacheManager(8, 4)
    manager.allocate("long", 9)
    manager.allocate("short", 2)
    tables = [manager.tables("long")[0], manager.tables("short")[0]]
    tensors = build(tables, [9, 2], 4)
    assert tensors.block_table.tolist() == [[0, 1, 2], [3, PAD_BLOCK_ID, PAD_BLOCK_ID]]
    assert_matches_tables(tensors, tables, [9, 2], manager)


def test_a_table_that_does_not_hold_its_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="request 0 of the step: 1 blocks of 4 for 5 tokens"):
        build_step_tensors([[0]], [5], [1], 4, CPU)


# -- planted bugs: each must make the property fail ---------------------------------------


def _off_by_one_seqused_k(token_counts: Sequence[int]) -> list[int]:
    return [count + 1 for count in token_counts]


_TABLE_ROWS = step_tensors.table_rows


def _swapped_rows(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return _TABLE_ROWS(block_ids)[::-1]


PLANTED: dict[str, tuple[str, Callable[..., list[int] | list[list[int]]]]] = {
    "off-by-one seqused_k": ("kv_lengths", _off_by_one_seqused_k),
    "swapped table rows": ("table_rows", _swapped_rows),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_metadata_bug_fails_the_property(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, planted = PLANTED[bug]
    monkeypatch.setattr(step_tensors, name, planted)
    tables, new_token_counts, manager = scenario()
    with pytest.raises(AssertionError):
        assert_matches_tables(
            build(tables, new_token_counts, manager.block_size), tables, new_token_counts, manager
        )
