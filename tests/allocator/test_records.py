"""The usage report's derived figures, at their edges.

mutmut 3 does not mutate decorated functions, so these two properties are pinned by hand.
"""

from spec import KVBlockUsage


def usage_report(allocated_tokens: int, reserved_tokens: int) -> KVBlockUsage:
    return KVBlockUsage(
        block_size=4,
        total_blocks=4,
        used_blocks=reserved_tokens // 4,
        free_blocks=4 - reserved_tokens // 4,
        request_count=1,
        allocated_tokens=allocated_tokens,
        reserved_tokens=reserved_tokens,
    )


def test_utilization_is_zero_when_nothing_is_reserved() -> None:
    empty = usage_report(0, 0)
    assert empty.block_utilization == 0.0
    assert empty.internal_fragmentation_tokens == 0


def test_full_blocks_have_no_fragmentation_and_full_utilization() -> None:
    full = usage_report(8, 8)
    assert full.internal_fragmentation_tokens == 0
    assert full.block_utilization == 1.0


def test_a_part_filled_block_shows_its_empty_slots() -> None:
    partial = usage_report(5, 8)
    assert partial.internal_fragmentation_tokens == 3
    assert partial.block_utilization == 5 / 8
