"""``python -m harness.bench.plots``: the figures of ``docs/results.md``, as PNGs.

Writes, under ``--out`` (default ``docs/img``):
- ``fragmentation_by_block_size.png``: block utilization and internal fragmentation
  against block size (1 to 256) on the ShareGPT-like trace (``harness.bench.allocator``),
  each request at its final length, with the article's six-request example marked;
- ``kv_memory.png``: the share of reserved KV memory holding token states under four
  schemes (``harness.bench.kv_memory``) on the ShareGPT-like and the prefix-heavy trace,
  and each trace's memory per step;
- ``decode_tok_s.png`` with ``--decode-json PATH`` (what ``python -m harness.bench.decode
  --json PATH`` writes): decode tokens/s against batch size, one line per method.
The fourth figure, the pool over a main-command run, is ``python -m harness --plot FILE``
(``harness.figures.plot_pool_over_time``). Every figure has the fixed size in pixels of
``harness.figures``.
"""

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes

from harness.bench.fragmentation import BlockSizePoint, sweep_block_sizes
from harness.bench.kv_memory import (
    SCHEMES,
    KVMemorySeries,
    measure_kv_memory,
    with_token_ids,
)
from harness.bench.prefix import prefix_heavy_trace
from harness.bench.traces import make_trace
from harness.figures import new_figure, save_figure
from harness.parsing import OneLineParser, fail, int_in, run_interruptible
from spec import MAX_BLOCK_SIZE

PROG = "python -m harness.bench.plots"
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ARTICLE_REQUEST_TOKENS = (9, 17, 33, 5, 41, 12)
ARTICLE_BLOCK_SIZE = 16
# Kwon et al., SOSP 2023, Figure 2: share of KV memory holding token states.
PAPER_EXISTING_SYSTEMS = (0.204, 0.382)
PAPER_VLLM = 0.96


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One row of ``harness.bench.decode --json``: a method at a batch size."""

    method: str
    batch_size: int
    decode_tok_s: float


def plot_fragmentation(
    points: Sequence[BlockSizePoint], article: Sequence[BlockSizePoint], path: Path
) -> None:
    """Utilization and waste per request against block size: the trace, and the article's
    example (its ``ARTICLE_BLOCK_SIZE`` point marked)."""
    figure, (utilization, waste) = new_figure(2)
    panels: tuple[tuple[Axes, Callable[[BlockSizePoint], float], str], ...] = (
        (utilization, _utilization_percent, "block utilization (%)"),
        (waste, _waste_per_request, "wasted token slots per request"),
    )
    for axes, value, label in panels:
        axes.plot(
            [p.block_size for p in points],
            [value(p) for p in points],
            "o-",
            label=f"ShareGPT-like trace ({points[0].request_count:,} requests)",
        )
        axes.plot(
            [p.block_size for p in article],
            [value(p) for p in article],
            "s--",
            color="grey",
            label="the article's 6 requests",
        )
        for point in article:
            if point.block_size == ARTICLE_BLOCK_SIZE:
                axes.plot(
                    [point.block_size],
                    [value(point)],
                    "*",
                    color="red",
                    markersize=16,
                    label=f"the article's example (block size {ARTICLE_BLOCK_SIZE})",
                )
                axes.annotate(
                    f"{value(point):.1f}",
                    (point.block_size, value(point)),
                    textcoords="offset points",
                    xytext=(8, -14),
                    color="red",
                )
        axes.set_xscale("log", base=2)
        axes.set_xticks(BLOCK_SIZES, [str(size) for size in BLOCK_SIZES])
        axes.set_xlabel("block size (tokens)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    utilization.set_ylim(0, 105)
    utilization.set_title("tokens held / token slots reserved")
    waste.set_title("internal fragmentation: empty slots in last blocks")
    utilization.legend(loc="lower left", fontsize=8)
    save_figure(figure, path)


def _utilization_percent(point: BlockSizePoint) -> float:
    return 100 * point.block_utilization


def _waste_per_request(point: BlockSizePoint) -> float:
    return point.fragmentation_tokens_per_request


def plot_kv_memory(series: Sequence[KVMemorySeries], path: Path) -> None:
    """The share of reserved memory holding tokens per scheme (bars, one colour per trace,
    the paper's figures as reference), then each trace's reserved memory per step."""
    figure, axes = new_figure(1 + len(series))
    bars = axes[0]
    width = 0.8 / len(series)
    for index, one in enumerate(series):
        shares = [100 * one.share_holding_tokens(scheme) for scheme in SCHEMES]
        xs = [x + (index - (len(series) - 1) / 2) * width for x in range(len(SCHEMES))]
        drawn = bars.bar(xs, shares, width, label=one.trace_name)
        bars.bar_label(drawn, fmt="%.0f", fontsize=8)
    low, high = PAPER_EXISTING_SYSTEMS
    bars.axhspan(
        100 * low,
        100 * high,
        color="orange",
        alpha=0.2,
        label=f"paper: existing systems {100 * low:.1f}-{100 * high:.1f}%",
    )
    bars.axhline(
        100 * PAPER_VLLM,
        color="green",
        linestyle="--",
        label=f"paper: vLLM {100 * PAPER_VLLM:.0f}%",
    )
    bars.set_xticks(range(len(SCHEMES)), [s.replace(", ", ",\n") for s in SCHEMES], fontsize=8)
    bars.set_ylim(0, 115)
    bars.set_ylabel("% of reserved KV memory holding tokens")
    bars.set_title("share holding tokens (summed over steps)")
    bars.legend(fontsize=7, loc="upper left")
    for axes_one, one in zip(axes[1:], series, strict=True):
        steps = range(len(one.reserved[SCHEMES[0]]))
        for scheme in SCHEMES:
            axes_one.plot(steps, one.reserved[scheme], label=scheme, linewidth=1)
        axes_one.plot(
            steps,
            one.stored[SCHEMES[0]],
            color="black",
            linewidth=1.5,
            linestyle=":",
            label="tokens the requests hold",
        )
        axes_one.set_yscale("log")
        axes_one.set_xlabel("step")
        axes_one.set_ylabel("KV token slots reserved")
        axes_one.set_title(f"{one.trace_name}, block size {one.block_size}")
        axes_one.grid(alpha=0.3)
        axes_one.legend(fontsize=7, loc="lower center")
    save_figure(figure, path)


def load_decode_rows(document: object) -> tuple[str, list[DecodeRow]]:
    """The rows of a ``harness.bench.decode --json`` document and a caption naming the
    machine, device, dtype and versions; ``ValueError`` says what is missing."""
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise ValueError("decode JSON: expected an object with a 'rows' list")
    rows = []
    for row in document["rows"]:
        try:
            rows.append(
                DecodeRow(str(row["method"]), int(row["batch_size"]), float(row["decode_tok_s"]))
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"decode JSON: bad row {row!r}: {error}") from None
    caption = ", ".join(
        f"{document[key]}" if key in ("machine", "device") else f"{key} {document[key]}"
        for key in ("machine", "device", "dtype", "torch", "transformers")
        if key in document
    )
    return caption, rows


def plot_decode(document: object, path: Path) -> None:
    """Decode tokens/s against batch size, one line per method."""
    caption, rows = load_decode_rows(document)
    figure, (axes,) = new_figure(1)
    methods = list(dict.fromkeys(row.method for row in rows))
    for method in methods:
        mine = sorted((r.batch_size, r.decode_tok_s) for r in rows if r.method == method)
        axes.plot([b for b, _ in mine], [t for _, t in mine], "o-", label=method)
    sizes = sorted({row.batch_size for row in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("batch size")
    axes.set_ylabel("decode tokens/s")
    axes.set_title(f"decode throughput\n{caption}", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    save_figure(figure, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="directory to write")
    parser.add_argument("--requests", type=int_in(1), default=2_000, help="requests in each trace")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument(
        "--block-size",
        type=int_in(1, MAX_BLOCK_SIZE),
        default=16,
        help="block size of kv_memory.png",
    )
    parser.add_argument("--max-running", type=int_in(1), default=256, help="seats in kv_memory.png")
    parser.add_argument("--decode-json", type=Path, default=None, help="decode benchmark JSON")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        return fail(PROG, f"--out: no directory {str(args.out)!r}")
    decode_document: object = None
    if args.decode_json is not None:
        try:
            decode_document = json.loads(args.decode_json.read_text())
            load_decode_rows(decode_document)
        except (OSError, ValueError) as error:
            return fail(PROG, f"--decode-json {args.decode_json}: {error}")
    trace = make_trace(args.requests, args.seed)
    final_tokens = [r.prompt_tokens + r.output_tokens for r in trace]
    points = sweep_block_sizes(final_tokens, BLOCK_SIZES)
    article = sweep_block_sizes(ARTICLE_REQUEST_TOKENS, BLOCK_SIZES)
    plot_fragmentation(points, article, args.out / "fragmentation_by_block_size.png")
    _wrote(args.out / "fragmentation_by_block_size.png")
    print("| block size | utilization | wasted slots per request |\n|---:|---:|---:|")
    for point in points:
        print(
            f"| {point.block_size} | {point.block_utilization:.1%} "
            f"| {point.fragmentation_tokens_per_request:.1f} |"
        )
    series = [
        measure_kv_memory(
            "ShareGPT-like",
            with_token_ids(trace, args.seed),
            args.block_size,
            args.max_running,
            args.seed,
        ),
        measure_kv_memory(
            "prefix-heavy",
            prefix_heavy_trace(args.requests, args.seed),
            args.block_size,
            args.max_running,
            args.seed,
        ),
    ]
    plot_kv_memory(series, args.out / "kv_memory.png")
    _wrote(args.out / "kv_memory.png")
    print(f"| trace | {' | '.join(SCHEMES)} |\n|---|{'---:|' * len(SCHEMES)}")
    for one in series:
        shares = " | ".join(f"{one.share_holding_tokens(s):.1%}" for s in SCHEMES)
        peaks = " | ".join(f"{max(one.reserved[s]):,}" for s in SCHEMES)
        print(f"| {one.trace_name}: share holding tokens | {shares} |")
        print(f"| {one.trace_name}: peak slots reserved | {peaks} |")
    if decode_document is None:
        print("decode_tok_s.png skipped: no --decode-json given")
    else:
        plot_decode(decode_document, args.out / "decode_tok_s.png")
        _wrote(args.out / "decode_tok_s.png")
    return 0


def _wrote(path: Path) -> None:
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
