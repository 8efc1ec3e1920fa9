"""scripts/fuzz.sh's workers stop at the deadline's interrupt.

Each worker is a command the script starts with ``&``; a non-interactive shell starts such
commands with SIGINT ignored, and Python keeps it ignored, so the interrupt used to do
nothing. The fuzz target module turns it back on.
"""

import signal
import subprocess
import sys


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_the_fuzz_target_takes_the_interrupt_back_when_started_with_it_ignored() -> None:
    probe = (
        "import signal, tests.support.fuzz_targets; "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=_ignore_sigint,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.strip() == "True"
