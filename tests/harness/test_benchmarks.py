"""The benchmark scripts run end to end on tiny inputs (smoke runs: no time is asserted)."""

import argparse
import json
import os
from pathlib import Path

import pytest

from harness.bench import allocator as bench_allocator
from harness.bench import api_cost as bench_api_cost
from harness.bench import decode as bench_decode
from harness.bench import events as bench_events
from harness.bench import host_prefix as bench_host_prefix
from harness.bench import preemption as bench_preemption
from harness.bench import speculation as bench_speculation
from harness.bench import window_table as bench_window_table
from harness.cli.pagedkv import main as pagedkv_main


def test_the_decode_benchmark_prints_a_row_per_method_and_batch_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tiny", "--methods", "dense,paged", "--batch-sizes", "1,3"]
    assert bench_decode.main([*argv, "--max-new-tokens", "3", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("dense", "1"),
        ("paged", "1"),
        ("dense", "3"),
        ("paged", "3"),
    ]
    # Dense is its own reference; NaN when a loaded machine made the first-token run of
    # this 3-token smoke run no faster than the whole run (Rates.decode says so).
    assert all(row[3] in ("1.00x", "nanx") for row in rows if row[0] == "dense")


def test_the_decode_benchmark_runs_hf_generate_batch_on_the_same_tokens_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "decode.json"
    argv = ["--tiny", "--batch-sizes", "2", "--max-new-tokens", "3", "--repeats", "1"]
    assert bench_decode.main([*argv, "--json", str(path), "--machine", "test box"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"dense", "paged", "hf-cb"}
    # The last column: requests whose tokens equal the paged engine's.
    assert rows["hf-cb"][-1] == "2/2"
    assert rows["dense"][-1] == "2/2"
    written = json.loads(path.read_text())
    assert set(written) == {"machine", "device", "dtype", "torch", "transformers", "rows"}
    assert (written["machine"], written["device"], written["dtype"]) == (
        "test box",
        "cpu",
        "float32",
    )
    assert [(row["method"], row["batch_size"]) for row in written["rows"]] == [
        ("dense", 2),
        ("paged", 2),
        ("hf-cb", 2),
    ]
    assert all(
        set(row) == {"method", "batch_size", "decode_tok_s", "e2e_tok_s", "decode_ratio_vs_dense"}
        for row in written["rows"]
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch-sizes", "1,x"],
        ["--batch-sizes", "0"],
        ["--methods", "dense,vllm"],
    ],
)
def test_the_decode_benchmark_refuses_bad_input_with_exit_code_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_decode.main(["--tiny", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(bench_decode.PROG)


def test_the_allocator_benchmark_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "50", "--spec-requests", "10", "--runs", "1", "--prefix-requests", "0"]
    assert bench_allocator.main([*argv, "--window-requests", "0"]) == 0
    out = capsys.readouterr().out
    assert "| impl append, 8,192 blocks | 50 |" in out
    assert "| impl article layer append_slot, 8,192 blocks | 50 |" in out
    assert "| impl article layer append_tokens, 8,192 blocks | 50 |" in out
    assert "| article-style append_tokens, 8,192 blocks | 50 |" in out
    assert "| spec append, 1,024 blocks | 10 |" in out
    assert "impl append, tight loop" in out
    assert "impl append_slot, tight loop" in out


def test_the_speculation_benchmark_prints_both_prompt_sets_with_and_without_drafts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tiny", "--max-new-tokens", "3", "--repeats", "1", "--speculate", "2"]
    assert bench_speculation.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("quoting", "plain"),
        ("quoting", "spec"),
        ("chat", "plain"),
        ("chat", "spec"),
    ]
    assert all(row[-1] == "yes" for row in rows)  # the same tokens with and without drafts


def test_the_allocator_benchmark_prints_the_sliding_window_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(
        seed=0,
        block_size=16,
        runs=1,
        max_running=256,
        long_max_running=16,
        window_total_blocks=16384,
    )
    bench_window_table.print_window_table(args, requests=20, long_requests=2)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    long_rows = {row[1]: row for row in rows if row[0] == "| long-context"}
    assert list(long_rows) == ["full", "Mistral-like", "full x2", "Gemma-like"]
    # Prompts of 8k+ tokens against a 4,096-token window: the windowed groups hold less.
    assert long_rows["full"][4] == long_rows["full x2"][4] == "1.00"
    assert float(long_rows["Mistral-like"][4]) < 1.0
    assert float(long_rows["Gemma-like"][4]) < 1.0


def test_the_host_prefix_benchmark_shows_the_hits_a_host_tier_adds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--requests", "80", "--systems", "8", "--system-tokens", "128", "--runs", "1"]
    sizes = ["--total-blocks", "320", "--host-blocks", "256", "--max-running", "8"]
    assert bench_host_prefix.main([*argv, *sizes]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["| 0", "| 256"]
    without, with_host = rows
    assert without[3] == "0" and without[4] == "+0"
    assert int(with_host[3].replace(",", "")) > 0  # tokens hit on the host only
    assert int(with_host[4].replace(",", "")) > 0  # more prompt tokens hit than without


def test_the_preemption_benchmark_swaps_on_the_tight_pool_and_recomputes_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tiny", "--runs", "1", "--max-new-tokens", "16", "--block-size", "4"]
    assert bench_preemption.main([*argv, "--arrival-gap", "1"]) == 0
    rows = {
        line.split(" | ")[0]: line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| preemption")
    }
    assert list(rows) == ["| roomy", "| recompute", "| swap"]
    assert rows["| roomy"][3] == "0 / 0"
    swaps, recomputes = rows["| swap"][3].split(" / ")
    assert int(swaps) > 0 and recomputes == "0" and rows["| swap"][4] == "0"
    assert rows["| recompute"][3].startswith("0 / ") and int(rows["| recompute"][4]) > 0


def test_the_events_benchmark_prints_both_batch_sets_for_the_three_publishers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM (the conformance extra)")
    assert bench_events.main(["--batches", "30", "--repeats", "1", "--requests", "20"]) == 0
    out, err = capsys.readouterr()
    header, _, *rows = out.splitlines()[1:]
    assert header.split(" | ")[1:4] == list(bench_events.METHODS)
    assert [row.split(" | ")[0] for row in rows] == ["| empty", "| trace"]
    assert all(float(cell.replace(",", "")) > 0 for row in rows for cell in row.split(" | ")[1:4])
    assert "trace: vLLM 0.33 (building), round 1/1" in err


# Issue 33, items 7 and 8: past the allocator's bounds each ended in a traceback (exit 1),
# --total-blocks 0 ran the default pool, and --threads 0 or 10**9 went to torch (a
# traceback, or libgomp aborting out of memory).
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["allocator", "--block-size", "70000", "--requests", "10", "--runs", "1"],
            "argument --block-size: must be in [1, 65,536], got 70,000",
        ),
        *(
            (
                [*command, "--total-blocks", "16777217"],
                "argument --total-blocks: must be in [1, 16,777,216], got 16,777,217",
            )
            for command in (["allocator"], ["host_prefix"], ["preemption", "--tiny"])
        ),
        (
            ["preemption", "--tiny", "--total-blocks", "0"],
            "argument --total-blocks: must be in [1, 16,777,216], got 0",
        ),
        (
            ["preemption", "--tiny", "--total-blocks", "16777216"],
            "--total-blocks 16777216: the run's K/V needs 128.00 GiB: a pool of 16777216 blocks",
        ),
        (
            ["preemption", "--tiny", "--block-size", "1024"],
            "--block-size 1024 is larger than the model's context of 512 tokens",
        ),
        *(
            (
                [name, *(["--tiny"] if name != "attention" else []), "--threads", threads],
                f"argument --threads: must be between 1 and {len(os.sched_getaffinity(0))} "
                f"(the CPUs here), got {threads}",
            )
            for name in ("decode", "attention", "preemption", "speculation")
            for threads in ("0", "1000000000")
        ),
    ],
)
def test_bad_counts_are_one_line_and_exit_2_before_the_benchmark_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: object
    try:
        code = pagedkv_main(["bench", *argv])
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m harness.bench.{argv[0]}: error: {message}")


def test_the_api_cost_benchmark_compares_two_checkouts_taking_turns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    this_checkout = Path(bench_api_cost.__file__).resolve().parents[2]
    argv = ["--before", str(this_checkout), "--rounds", "1", "--requests", "40"]
    assert bench_api_cost.main(argv) == 0
    out, err = capsys.readouterr()
    rows = out.splitlines()[2:]
    assert len(rows) == 14 and rows[0].startswith("| trace, engine decode call")
    assert "round 1/1: before" in err and "round 1/1: after" in err


def test_the_api_cost_benchmark_refuses_bad_input_with_exit_code_2() -> None:
    assert bench_api_cost.main(["--before", "/nonexistent"]) == 2
    assert bench_api_cost.main(["--before", ".", "--rounds", "0"]) == 2
