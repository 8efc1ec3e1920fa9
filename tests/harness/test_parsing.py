"""The command-line plumbing every script shares: bounded integer options, ``--threads``,
and Ctrl-C as one line and exit 130 from the first instant, imports included."""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.parsing import (
    EXIT_INTERRUPTED,
    exit_on_interrupt,
    int_in,
    interrupts_raise,
    thread_count,
)

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).parent / "pagedkv"


@pytest.mark.parametrize(
    ("text", "bounds", "message"),
    [
        ("x", (1, None), "invalid int value: 'x'"),
        ("1.5", (1, None), "invalid int value: '1.5'"),
        ("0", (1, None), "must be >= 1, got 0"),
        ("0", (1, 65_536), "must be in [1, 65,536], got 0"),
        ("70000", (1, 65_536), "must be in [1, 65,536], got 70,000"),
    ],
)
def test_a_bounded_int_option_refuses_what_is_outside(
    text: str, bounds: tuple[int, int | None], message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        int_in(*bounds)(text)
    assert str(refused.value) == message


def test_a_bounded_int_option_takes_its_edges() -> None:
    assert int_in(1, 65_536)("1") == 1
    assert int_in(1, 65_536)("65536") == 65_536
    assert int_in(0)("0") == 0


@pytest.mark.parametrize("text", ["0", "-1", str(len(os.sched_getaffinity(0)) + 1), "1000000000"])
def test_threads_are_between_one_and_the_cpus_here(text: str) -> None:
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        thread_count(text)
    assert str(refused.value) == f"must be between 1 and {cpus} (the CPUs here), got {text}"
    assert thread_count(str(cpus)) == cpus


def test_the_startup_handler_is_undone_and_leaves_an_ignored_sigint_alone() -> None:
    before = signal.getsignal(signal.SIGINT)  # (a fuzz target imported here sets its own)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        exit_on_interrupt("prog")
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        interrupts_raise()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_on_interrupt("prog")
        interrupts_raise()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# (command, its program name, the module whose import completing triggers the Ctrl-C).
# "harness" is the earliest point: the package's __init__ sets the handler; "torch" is
# ~2 s into the import of torch and transformers; conformance imports Hypothesis first.
STARTS = [
    ([sys.executable, "-m", "harness"], "python -m harness", "harness"),
    ([sys.executable, "-m", "harness"], "python -m harness", "torch"),
    ([CONSOLE_SCRIPT, "check"], "pagedkv check", "torch"),
    ([CONSOLE_SCRIPT, "bench", "decode"], "pagedkv bench decode", "torch"),
    ([sys.executable, "-m", "harness.bench.decode"], "python -m harness.bench.decode", "torch"),
    ([sys.executable, "-m", "harness.conformance"], "python -m harness.conformance", "hypothesis"),
]


@pytest.mark.parametrize(("command", "prog", "trigger"), STARTS)
def test_ctrl_c_while_a_command_imports_is_one_line_and_exit_130(
    command: list[str | Path], prog: str, trigger: str
) -> None:
    # Python's import log (one stderr line as each import completes) says how far it got.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1"},
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == trigger:
            process.send_signal(signal.SIGINT)
            break
    else:
        pytest.fail(f"{trigger} was never imported")
    rest = process.stderr.read()
    assert process.wait(timeout=60) == EXIT_INTERRUPTED, rest
    said = [line for line in rest.splitlines() if not line.startswith("import time:")]
    assert said == [f"{prog}: interrupted while starting"]
