"""The block map: literal maps of small pools after a fork, a prefix hit, a copy-on-write
and a release that leaves a cached free block; labels, wrapping and colour."""

import pytest

from impl import KVCacheManager
from impl.block_map import (
    LEGEND,
    PoolSnapshot,
    compute_label,
    extend_labels,
    render_block_map,
    snapshot_pool,
)
from spec import RequestBlockTable


def test_a_fork_shares_every_block_and_the_partly_filled_last_block_is_marked_too() -> None:
    manager = KVCacheManager(6, 4)
    manager.allocate("req-a", 6)
    manager.fork("req-a", "req-b")
    assert render_block_map(snapshot_pool(manager.to_spec())) == "\n".join(
        [
            "pool: 6 blocks x 4 tokens; 2 used (2 shared), 0 cached free, 4 free",
            "0 [A* ][A*~][.  ][.  ][.  ][.  ]",
            "A  req-a: token_count = 6, block_ids = [0, 1]",
            "B  req-b: token_count = 6, block_ids = [0, 1]",
            "free_block_ids = [2, 3, 4, 5]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_a_copy_on_write_gives_the_child_its_own_last_block() -> None:
    manager = KVCacheManager(6, 4)
    manager.allocate("req-a", 6)
    manager.fork("req-a", "req-b")
    manager.append("req-b", 1).slots[0][0]
    assert manager.take_transfers().copies == ((1, 2),)
    assert render_block_map(snapshot_pool(manager.to_spec())) == "\n".join(
        [
            "pool: 6 blocks x 4 tokens; 3 used (1 shared), 0 cached free, 3 free",
            "0 [A* ][A ~][B ~][.  ][.  ][.  ]",
            "A  req-a: token_count = 6, block_ids = [0, 1]",
            "B  req-b: token_count = 7, block_ids = [0, 2]",
            "free_block_ids = [3, 4, 5]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_a_prefix_hit_shares_the_full_prompt_blocks_only() -> None:
    manager = KVCacheManager(6, 4)
    manager.allocate("req-a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = manager.allocate("req-b", [1, 2, 3, 4, 5, 6, 7, 8, 20, 21])
    assert hit.cached_tokens == 8
    assert render_block_map(snapshot_pool(manager.to_spec())) == "\n".join(
        [
            "pool: 6 blocks x 4 tokens; 4 used (2 shared), 0 cached free, 2 free",
            "0 [A* ][A* ][A ~][B ~][.  ][.  ]",
            "A  req-a: token_count = 9, block_ids = [0, 1, 2]",
            "B  req-b: token_count = 10, block_ids = [0, 1, 3]",
            "free_block_ids = [4, 5]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_a_released_full_block_is_cached_free_and_a_partial_one_plain_free() -> None:
    manager = KVCacheManager(6, 4)
    manager.allocate("req-a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    manager.allocate("req-b", [1, 2, 3, 4, 5, 6, 7, 8, 20])
    labels = extend_labels({}, ["req-a", "req-b"])
    manager.release("req-a")
    # Block 2 (tokens 9-12) keeps its cached prefix; block 3 (token 13) was never cached.
    # req-b keeps its label B, and the map wraps at 21 columns: three cells a row.
    assert render_block_map(snapshot_pool(manager.to_spec()), labels, width=21) == "\n".join(
        [
            "pool: 6 blocks x 4 tokens; 3 used (0 shared), 1 cached free, 2 free",
            "0 [B  ][B  ][:  ]",
            "3 [.  ][B ~][.  ]",
            "B  req-b: token_count = 9, block_ids = [0, 1, 4]",
            "free_block_ids = [5, 3]",
            "cached_free_block_ids = [2]",
            LEGEND,
        ]
    )


def test_labels_run_through_both_alphabets_then_take_two_letters() -> None:
    assert [compute_label(i) for i in (0, 25, 26, 51, 52, 53, 103, 104)] == [
        "A",
        "Z",
        "a",
        "z",
        "AA",
        "AB",
        "Az",
        "BA",
    ]


def test_a_request_keeps_its_label_and_new_ones_never_reuse_a_released_ones() -> None:
    labels = extend_labels({}, ["r0", "r1"])
    assert extend_labels(labels, ["r2", "r1"]) == {"r0": "A", "r1": "B", "r2": "C"}


def test_two_letter_labels_widen_every_cell() -> None:
    pool = PoolSnapshot(
        block_size=2,
        total_blocks=3,
        tables=(RequestBlockTable("x", (1,), 1),),
        ref_counts=(0, 1, 0),
        free_block_ids=(0, 2),
        cached_free_block_ids=(),
    )
    lines = render_block_map(pool, {"x": "AB"}).splitlines()
    assert lines[1] == "0 [.   ][AB ~][.   ]"
    assert lines[2] == "AB  x: token_count = 1, block_ids = [1]"


def test_a_pool_with_no_request_draws_one_column_cells() -> None:
    assert render_block_map(snapshot_pool(KVCacheManager(3, 4).to_spec())) == "\n".join(
        [
            "pool: 3 blocks x 4 tokens; 0 used (0 shared), 0 cached free, 3 free",
            "0 [.  ][.  ][.  ]",
            "free_block_ids = [0, 1, 2]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_a_row_holds_as_many_cells_as_fit_in_80_columns_by_default() -> None:
    # Two-letter cells of 6 columns after a two-digit id and a space: 12 cells take 75
    # columns, a 13th would take 81.
    pool = PoolSnapshot(
        block_size=2,
        total_blocks=13,
        tables=(RequestBlockTable("x", (0,), 1),),
        ref_counts=(1,) + (0,) * 12,
        free_block_ids=tuple(range(1, 13)),
        cached_free_block_ids=(),
    )
    assert render_block_map(pool, {"x": "AB"}).splitlines()[1:3] == [
        " 0 [AB ~]" + "[.   ]" * 11,
        "12 [.   ]",
    ]


@pytest.mark.parametrize(
    ("width", "rows"),
    [
        (12, ["0 [A  ][.  ]", "2 [.  ][.  ]"]),  # two cells fill 12 columns exactly
        (1, ["0 [A  ]", "1 [.  ]"]),  # narrower than one cell: still one a row
    ],
    ids=["filled-exactly", "narrower-than-a-cell"],
)
def test_a_row_holds_the_cells_that_fit_in_the_width_and_at_least_one(
    width: int, rows: list[str]
) -> None:
    manager = KVCacheManager(4, 4)
    manager.allocate("req-a", 4)
    assert render_block_map(snapshot_pool(manager.to_spec()), width=width).splitlines()[1:3] == rows


@pytest.mark.parametrize("color", [False, True])
def test_colour_escapes_appear_only_when_asked_for(color: bool) -> None:
    manager = KVCacheManager(2, 4)
    manager.allocate("req-a", 3)
    text = render_block_map(snapshot_pool(manager.to_spec()), color=color)
    assert ("\x1b[" in text) is color
    if color:
        assert "\x1b[31m[A ~]\x1b[0m\x1b[2m[.  ]\x1b[0m" in text
        assert "\n\x1b[31mA\x1b[0m  req-a: token_count = 3" in text  # the table's label too


def test_every_kv_cache_group_draws_its_blocks_as_held() -> None:
    manager = KVCacheManager(8, 4, group_windows=(None, 4))
    manager.allocate("a", 6)
    assert render_block_map(snapshot_pool(manager.to_spec())) == "\n".join(
        [
            "pool: 8 blocks x 4 tokens; 4 used (0 shared), 0 cached free, 4 free",
            "0 [A  ][A ~][A  ][A ~][.  ][.  ][.  ][.  ]",
            "A  a: token_count = 6, block_ids = [0, 1], group 1 block_ids = [2, 3]",
            "free_block_ids = [4, 5, 6, 7]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_a_block_a_window_skipped_is_drawn_free_and_the_table_says_what_it_skipped() -> None:
    manager = KVCacheManager(8, 2, group_windows=(None, 2))
    manager.allocate("a", 3)
    manager.append("a", 2)  # group 1's window no longer reads block index 0 (block 2)
    assert render_block_map(snapshot_pool(manager.to_spec())) == "\n".join(
        [
            "pool: 8 blocks x 2 tokens; 5 used (0 shared), 0 cached free, 3 free",
            "0 [A  ][A  ][.  ][A  ][A ~][A ~][.  ][.  ]",
            "A  a: token_count = 5, block_ids = [0, 1, 4], group 1 block_ids = [3, 5] (skipped 1)",
            "free_block_ids = [6, 7, 2]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )


def test_each_further_group_is_listed_after_the_last_in_group_order() -> None:
    manager = KVCacheManager(8, 4, group_windows=(None, 4, None))
    manager.allocate("a", 6)
    manager.append("a", 2)
    manager.append("a", 1)  # L0 = 8: group 1's window no longer reads block index 0
    assert render_block_map(snapshot_pool(manager.to_spec())).splitlines()[2] == (
        "A  a: token_count = 9, block_ids = [0, 1, 6], group 1 block_ids = [3, 7] (skipped 1), "
        "group 2 block_ids = [4, 5, 2]"
    )


def test_a_free_block_is_drawn_with_no_reference() -> None:
    manager = KVCacheManager(4, 2)
    manager.allocate("a", 3)
    assert snapshot_pool(manager.to_spec()).ref_counts == (1, 1, 0, 0)
