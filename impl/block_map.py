"""The pool drawn as text: which request holds which block, as the article draws them.

One cell per block, in block id order, wrapped to a width::

    pool: 8 blocks x 4 tokens; 4 used (1 shared), 1 cached free, 3 free
    0 [A* ][A ~][B ~][:  ][.  ][.  ][.  ][.  ]
    A  req-a: token_count = 6, block_ids = [0, 1]
    ...

A cell shows the label of the request holding the block, in any KV cache group (the first
in table order, for a shared block), then ``*`` if the block is shared (ref count > 1) and
``~`` if it is a request's partly filled last block; a free block is ``.``, a cached free
block (free, but still holding a cached prefix a prompt may hit) is ``:``. Under the
map, one line per request as the article prints its tables (with the block ids of every
further group), then the two free queues in their order.

It is *not* a live view: ``snapshot_pool`` reads a spec state (``KVCacheManager.to_spec()``),
and ``render_block_map`` is a pure function of that snapshot, so tests compare literal
strings.
Colour (ANSI) only when asked for; whether to ask is the caller's business.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spec import AllocatorState, RequestBlockTable

SHARED_MARK = "*"
PARTIAL_MARK = "~"
FREE_MARK = "."
CACHED_FREE_MARK = ":"
LEGEND = (
    f"{SHARED_MARK} shared (ref count > 1)  {PARTIAL_MARK} partly filled last block  "
    f"{FREE_MARK} free  {CACHED_FREE_MARK} cached free"
)
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Request colours cycle through these ANSI foreground codes; free cells are dim.
_COLOURS = ("31", "32", "33", "34", "35", "36", "91", "92", "93", "94", "95", "96")
_DIM = "2"


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """What the map draws: the pool's size, every table in table order (group 0's), the ref
    count of every block by id, and the two free queues in queue order. ``more_groups[i]``
    holds KV cache group i + 1's tables, in the same order (empty with one group)."""

    block_size: int
    total_blocks: int
    tables: tuple[RequestBlockTable, ...]
    ref_counts: tuple[int, ...]
    free_block_ids: tuple[int, ...]
    cached_free_block_ids: tuple[int, ...]
    more_groups: tuple[tuple[RequestBlockTable, ...], ...] = ()


def snapshot_pool(state: AllocatorState) -> PoolSnapshot:
    """What the map draws of a pool in ``state`` (``KVCacheManager.to_spec()``); O(pool)."""
    return PoolSnapshot(
        block_size=state.block_size,
        total_blocks=state.total_blocks,
        tables=tuple(state.tables.values()),
        ref_counts=tuple(state.ref_counts.get(b, 0) for b in range(state.total_blocks)),
        free_block_ids=state.free_block_ids,
        cached_free_block_ids=state.cached_free_block_ids,
        more_groups=tuple(tuple(tables.values()) for tables in state.group_tables[1:]),
    )


def compute_label(index: int) -> str:
    """The ``index``-th short label: ``A``..``Z``, ``a``..``z``, then ``AA``, ``AB``, ..."""
    base = len(_ALPHABET)
    label = _ALPHABET[index % base]
    index //= base
    while index:
        index -= 1
        label = _ALPHABET[index % base] + label
        index //= base
    return label


def extend_labels(labels: Mapping[str, str], request_ids: Iterable[str]) -> dict[str, str]:
    """``labels`` plus a new label for every request id it lacks, in order.

    A request keeps its label for good, so the maps of one run can be read side by side.
    """
    extended = dict(labels)
    for request_id in request_ids:
        if request_id not in extended:
            extended[request_id] = compute_label(len(extended))
    return extended


def render_block_map(
    pool: PoolSnapshot,
    labels: Mapping[str, str] | None = None,
    *,
    width: int = 80,
    color: bool = False,
) -> str:
    """The map of ``pool`` as lines of text (no trailing newline).

    ``labels`` names requests (default: ``A``, ``B``, ... in table order; a request missing
    from it gets the next free label). Map rows hold as many cells as fit in ``width``
    columns (at least one), each row led by its first block id.
    """
    labels = extend_labels(labels or {}, (table.request_id for table in pool.tables))
    holder: dict[int, str] = {}
    partial: set[int] = set()
    for table in (table for group in (pool.tables, *pool.more_groups) for table in group):
        for block_id in table.block_ids:
            holder.setdefault(block_id, table.request_id)
        if table.token_count % pool.block_size and table.block_ids:
            partial.add(table.block_ids[-1])
    cached_free = set(pool.cached_free_block_ids)
    label_width = max((len(labels[table.request_id]) for table in pool.tables), default=1)
    colours = {request_id: _COLOURS[i % len(_COLOURS)] for i, request_id in enumerate(labels)}

    def cell(block_id: int) -> str:
        request_id = holder.get(block_id)
        if request_id is None:
            mark = CACHED_FREE_MARK if block_id in cached_free else FREE_MARK
            return _paint(f"[{mark:<{label_width}}  ]", _DIM, color)
        shared = SHARED_MARK if pool.ref_counts[block_id] > 1 else " "
        filled = PARTIAL_MARK if block_id in partial else " "
        text = f"[{labels[request_id]:<{label_width}}{shared}{filled}]"
        return _paint(text, colours[request_id], color)

    id_width = len(str(pool.total_blocks - 1))
    cell_width = label_width + 4
    per_row = max(1, (width - id_width - 1) // cell_width)
    used = pool.total_blocks - len(pool.free_block_ids) - len(pool.cached_free_block_ids)
    shared_count = sum(1 for count in pool.ref_counts if count > 1)
    lines = [
        f"pool: {pool.total_blocks} blocks x {pool.block_size} tokens; {used} used "
        f"({shared_count} shared), {len(pool.cached_free_block_ids)} cached free, "
        f"{len(pool.free_block_ids)} free"
    ]
    for start in range(0, pool.total_blocks, per_row):
        end = min(start + per_row, pool.total_blocks)
        cells = "".join(cell(block_id) for block_id in range(start, end))
        lines.append(f"{start:>{id_width}} {cells}")
    for index, table in enumerate(pool.tables):
        label = _paint(
            f"{labels[table.request_id]:<{label_width}}", colours[table.request_id], color
        )
        more = "".join(
            f", group {group} block_ids = {list(tables[index].block_ids)}"
            + (f" (skipped {tables[index].skipped_blocks})" if tables[index].skipped_blocks else "")
            for group, tables in enumerate(pool.more_groups, start=1)
        )
        lines.append(
            f"{label}  {table.request_id}: token_count = {table.token_count}, "
            f"block_ids = {list(table.block_ids)}{more}"
        )
    lines.append(f"free_block_ids = {list(pool.free_block_ids)}")
    lines.append(f"cached_free_block_ids = {list(pool.cached_free_block_ids)}")
    lines.append(LEGEND)
    return "\n".join(lines)


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color else text
