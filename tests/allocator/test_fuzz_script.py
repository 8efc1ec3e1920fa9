"""Fuzz workers stop at the interrupt (scripts/fuzz.sh's deadline, a cluster run's Ctrl-C).

Each fuzz.sh worker is a command the script starts with ``&``; a non-interactive shell
starts such commands with SIGINT ignored, and Python keeps it ignored, so the interrupt used
to do nothing. The fuzz target module turns it back on, and raises an interrupt that Python
lost inside a finalizer again at the machine's next step.
"""

import signal
import subprocess
import sys
from pathlib import Path


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_the_fuzz_target_takes_the_interrupt_back_when_started_with_it_ignored() -> None:
    probe = (
        "import signal, tests.support.fuzz_targets; "
        "print(signal.getsignal(signal.SIGINT).__module__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=_ignore_sigint,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.strip() == "tests.support.fuzz_targets"


def test_an_interrupt_lost_inside_a_finalizer_stops_the_machine_at_its_next_step() -> None:
    probe = """
import os, signal, sys
from tests.support.fuzz_targets import CountingAllocatorMachine

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # Python runs the handler here: its KeyboardInterrupt is ignored

sys.unraisablehook = lambda unraisable: print(type(unraisable.exc_value).__name__, "lost")
Finalized()
try:
    CountingAllocatorMachine().count_a_check()
    print("fuzzing on")
except KeyboardInterrupt:
    print("stopped")
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split("\n") == ["KeyboardInterrupt lost", "stopped", ""]


def test_a_run_in_which_no_worker_fuzzed_says_so_in_one_line_and_fails() -> None:
    # 0 seconds: no worker starts pytest, so no tally is written. The summary used to read
    # the missing tallies under pipefail and end the script with status 1 and no word.
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [str(root / "scripts" / "fuzz.sh"), "0", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        "fuzz: no worker finished a test run in 0s, so nothing was fuzzed (see .hypothesis/"
    ), done.stderr
