"""The lockstep state machine as a long-fuzzing target, counting what it runs.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``scripts/fuzz.sh`` and ``hypothesis fuzz`` name it explicitly. It is the same machine as
``tests/lockstep.py``; the only addition is a tally of test cases and steps, written to
the file named by ``PAGEDKV_FUZZ_TALLY`` when the process exits, so a fuzzing session can
report how much it ran.
"""

import atexit
import os

from hypothesis.stateful import invariant

from tests.lockstep import AllocatorMachine


class Tally:
    """Test cases finished and invariant checks run (one after init, one after each step)."""

    cases = 0
    checks = 0

    @classmethod
    def steps(cls) -> int:
        return cls.checks - cls.cases


class CountingAllocatorMachine(AllocatorMachine):
    """``AllocatorMachine`` that tallies its test cases and steps."""

    @invariant()
    def count_a_check(self) -> None:
        Tally.checks += 1

    def teardown(self) -> None:
        Tally.cases += 1
        super().teardown()


TestFuzzImplAgreesWithSpec = CountingAllocatorMachine.TestCase


def _write_tally() -> None:
    path = os.environ.get("PAGEDKV_FUZZ_TALLY")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"cases={Tally.cases} steps={Tally.steps()}\n")


atexit.register(_write_tally)
