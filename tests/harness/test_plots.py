"""The plots: each function writes a PNG of its fixed size from a tiny input, with no display;
the command writes the figures and skips the decode one without its JSON."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness import figures
from harness.bench import plots
from harness.bench.fragmentation import sweep_block_sizes
from harness.bench.kv_memory import measure_kv_memory
from harness.bench.prefix import PromptRequest
from harness.cli.main import main as harness_main
from harness.runtime.results import UsageSample

PANEL = (700, 450)  # pixels of one panel: PANEL_WIDTH x FIGURE_HEIGHT at DPI
DECODE_DOCUMENT = {
    "machine": "test machine",
    "device": "cpu",
    "dtype": "float32",
    "torch": "2.13.0",
    "transformers": "5.23.0",
    "rows": [
        {
            "method": method,
            "batch_size": batch,
            "decode_tok_s": rate,
            "e2e_tok_s": rate / 2,
            "decode_ratio_vs_dense": 1.0,
        }
        for method, batch, rate in [
            ("dense", 1, 10.0),
            ("dense", 8, 60.0),
            ("paged", 1, 9.5),
            ("paged", 8, 61.0),
        ]
    ],
}


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk; fails if the file is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_module_draws_with_agg_even_when_the_environment_asks_for_another_backend() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import harness.bench.plots, matplotlib; print(matplotlib.get_backend())",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MPLBACKEND": "svg"},
    )
    assert done.stdout.strip().lower() == "agg"


def test_the_fragmentation_plot_is_two_panels_wide(tmp_path: Path) -> None:
    path = tmp_path / "fragmentation.png"
    plots.plot_fragmentation(
        sweep_block_sizes([5, 30], (1, 16)), sweep_block_sizes([9, 17], (1, 16)), path
    )
    assert png_size(path) == (2 * PANEL[0], PANEL[1])


def test_the_kv_memory_plot_has_the_bars_and_a_panel_per_trace(tmp_path: Path) -> None:
    trace = [PromptRequest("a", (1, 2, 3), 2), PromptRequest("b", (1, 2, 4), 1)]
    series = measure_kv_memory("tiny", trace, block_size=2, max_running=2, seed=0)
    path = tmp_path / "kv.png"
    plots.plot_kv_memory([series, series], path)
    assert png_size(path) == (3 * PANEL[0], PANEL[1])


def test_the_pool_plot_marks_preemptions_from_the_counter(tmp_path: Path) -> None:
    usage = [
        UsageSample(3, 1, 10, 12, 3, cached_free_blocks=1, preemptions=0),
        UsageSample(4, 2, 14, 16, 4, cached_free_blocks=0, preemptions=1),
        UsageSample(2, 1, 7, 8, 2, cached_free_blocks=2, preemptions=1),
    ]
    assert figures.preemption_steps(usage) == [1]
    path = tmp_path / "pool.png"
    figures.plot_pool_over_time(usage, 6, path)
    assert png_size(path) == PANEL


def test_the_decode_plot_reads_the_benchmarks_json(tmp_path: Path) -> None:
    path = tmp_path / "decode.png"
    plots.plot_decode(DECODE_DOCUMENT, path)
    assert png_size(path) == PANEL


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"rows": "none"}, "expected an object with a 'rows' list"),
        ({"rows": [{"method": "dense", "batch_size": 1}]}, "bad row"),
    ],
)
def test_a_decode_document_without_its_rows_is_refused(document: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plots.load_decode_rows(document)


def test_the_command_writes_two_figures_and_skips_decode_without_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plots.main(["--out", str(tmp_path), "--requests", "6"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fragmentation_by_block_size.png",
        "kv_memory.png",
    ]
    assert "decode_tok_s.png skipped: no --decode-json given" in capsys.readouterr().out


def test_the_command_draws_decode_from_its_json(tmp_path: Path) -> None:
    decode_json = tmp_path / "decode.json"
    decode_json.write_text(json.dumps(DECODE_DOCUMENT))
    assert (
        plots.main(["--out", str(tmp_path), "--requests", "3", "--decode-json", str(decode_json)])
        == 0
    )
    assert png_size(tmp_path / "decode_tok_s.png") == PANEL


def test_a_bad_decode_json_exits_2_with_one_line(tmp_path: Path) -> None:
    decode_json = tmp_path / "decode.json"
    decode_json.write_text("{}")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.bench.plots",
            "--out",
            str(tmp_path),
            "--decode-json",
            str(decode_json),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "expected an object with a 'rows' list" in done.stderr


def test_the_main_command_refuses_a_plot_into_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere" / "pool.png"
    # A missing model too: were --plot not checked first, its error would show instead.
    args = ["--device", "cpu", "--model", str(tmp_path / "no-model"), "--plot", str(missing)]
    assert harness_main(args) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"--plot: no directory {str(missing.parent)!r} to write into")
    )
