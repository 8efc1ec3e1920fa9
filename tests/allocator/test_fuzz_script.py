"""Fuzz workers stop at the interrupt (scripts/fuzz.sh's deadline, a cluster run's Ctrl-C).

Each fuzz.sh worker is a command the script starts with ``&``; a non-interactive shell
starts such commands with SIGINT ignored, and Python keeps it ignored, so the interrupt used
to do nothing. The fuzz target module turns it back on, and raises an interrupt that Python
lost inside a finalizer again at the machine's next step.
"""

import signal
import subprocess
import sys


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
