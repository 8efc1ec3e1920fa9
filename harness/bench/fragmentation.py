"""The article's fragmentation figures: paged blocks against contiguous fixed-slot reservation.

For example ``python -m harness.bench.fragmentation --request-tokens 9,17,33,5,41,12`` allocates
each request's tokens in a ``KVCacheManager`` and prints, as JSON, the pool's usage next to
what a contiguous allocator would reserve if it gave every request the longest request's
length. Needs no model and no torch. With ``--map`` it prints the pool as a block map
(``impl.block_map``) instead.
"""

import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from harness.parsing import OneLineParser, fail, int_in, run_interruptible
from impl import BlockAllocationError, KVCacheManager
from impl.block_map import render_block_map, snapshot_pool
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS, blocks_for_tokens

PROG = "python -m harness.bench.fragmentation"


def parse_request_tokens(text: str) -> list[int]:
    """A comma-separated list of positive token counts; ``ValueError`` names the bad item."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"--request-tokens needs a comma-separated list of counts, got {text!r}")
    counts = []
    for item in items:
        try:
            count = int(item)
        except ValueError:
            raise ValueError(f"--request-tokens: {item!r} is not a whole number") from None
        if count < 1:
            raise ValueError(f"--request-tokens: every request needs >= 1 token, got {count}")
        counts.append(count)
    return counts


def allocate_requests(
    block_size: int, total_blocks: int, request_tokens: Sequence[int]
) -> KVCacheManager:
    """A pool with request ``request-{i}`` allocated ``request_tokens[i]`` tokens, in order."""
    manager = KVCacheManager(total_blocks, block_size)
    for index, token_count in enumerate(request_tokens):
        manager.allocate(f"request-{index}", token_count)
    return manager


@dataclass(frozen=True, slots=True)
class BlockSizePoint:
    """The requests allocated in blocks of ``block_size``: utilization and waste."""

    block_size: int
    block_utilization: float
    internal_fragmentation_tokens: int
    request_count: int

    @property
    def fragmentation_tokens_per_request(self) -> float:
        """Slots reserved but not holding a token, per request (mean)."""
        return self.internal_fragmentation_tokens / self.request_count


def sweep_block_sizes(
    request_tokens: Sequence[int], block_sizes: Sequence[int]
) -> list[BlockSizePoint]:
    """The requests allocated at their token counts in a pool just big enough, per size."""
    points = []
    for block_size in block_sizes:
        total_blocks = sum(blocks_for_tokens(block_size, count) for count in request_tokens)
        usage = allocate_requests(block_size, total_blocks, request_tokens).usage()
        points.append(
            BlockSizePoint(
                block_size,
                usage.block_utilization,
                usage.internal_fragmentation_tokens,
                len(request_tokens),
            )
        )
    return points


def fragmentation_report(
    block_size: int, total_blocks: int, request_tokens: Sequence[int]
) -> dict[str, object]:
    """Allocate every request and compare with contiguous reservation at the longest length."""
    usage = allocate_requests(block_size, total_blocks, request_tokens).usage()
    allocated = sum(request_tokens)
    # A contiguous allocator that cannot grow a request in place reserves the longest
    # length for every request (the fixed-slot baseline of the article).
    contiguous_reserved = max(request_tokens) * len(request_tokens)
    contiguous_fragmentation = contiguous_reserved - allocated
    return {
        "block_size": block_size,
        "request_tokens": list(request_tokens),
        "block_usage": {
            "block_size": usage.block_size,
            "total_blocks": usage.total_blocks,
            "used_blocks": usage.used_blocks,
            "free_blocks": usage.free_blocks,
            "request_count": usage.request_count,
            "allocated_tokens": usage.allocated_tokens,
            "reserved_tokens": usage.reserved_tokens,
            "internal_fragmentation_tokens": usage.internal_fragmentation_tokens,
            "block_utilization": usage.block_utilization,
        },
        "contiguous_fixed_slot_baseline": {
            "slot_tokens": max(request_tokens),
            "allocated_tokens": allocated,
            "reserved_tokens": contiguous_reserved,
            "internal_fragmentation_tokens": contiguous_fragmentation,
            "utilization": allocated / contiguous_reserved,
        },
        "fragmentation_tokens_saved_vs_contiguous": (
            contiguous_fragmentation - usage.internal_fragmentation_tokens
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=PROG,
        description=(
            "Allocate requests of the given token counts in a paged KV pool and print, as "
            "JSON, its usage (reserved tokens, internal fragmentation, block utilization) "
            "against a contiguous allocator that reserves the longest request's length "
            "for every request."
        ),
    )
    parser.add_argument(
        "--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16, help="tokens per block"
    )
    parser.add_argument(
        "--total-blocks", type=int_in(1, MAX_TOTAL_BLOCKS), default=64, help="blocks in the pool"
    )
    parser.add_argument(
        "--request-tokens",
        default="9,17,33,5,41,12",
        help="comma-separated token counts, one per request (default: the article's example)",
    )
    parser.add_argument(
        "--map",
        action="store_true",
        help="print the pool as a block map (one cell per block) instead of the JSON report",
    )
    args = parser.parse_args(argv)
    try:
        request_tokens = parse_request_tokens(args.request_tokens)
        report = fragmentation_report(args.block_size, args.total_blocks, request_tokens)
        manager = allocate_requests(args.block_size, args.total_blocks, request_tokens)
    except ValueError as error:
        return fail(PROG, str(error))
    except BlockAllocationError as error:
        return fail(PROG, f"the pool of {args.total_blocks} blocks is too small: {error}")
    if args.map:
        width = shutil.get_terminal_size().columns
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(render_block_map(snapshot_pool(manager.to_spec()), width=width, color=color))
    else:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
