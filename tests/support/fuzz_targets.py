"""The lockstep state machine as a long-fuzzing target, counting what it runs.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``scripts/fuzz.sh`` and ``hypothesis fuzz`` name it explicitly. Its machines are those of
``tests/support/lockstep.py`` (on the real impl, and on it under a constantly colliding
hash) and ``tests/support/host_lockstep.py`` (with a host tier), and the metamorphic
relations of ``tests/support/metamorphic.py`` and ``tests/support/stream_consumers.py``;
the only addition is a tally of test cases and steps. When
``PAGEDKV_FUZZ_TALLY`` names a directory, each process keeps ``<pid>.txt`` there up to
date (every 10 cases and at exit), so a fuzzing session can report how much it ran even
when its worker processes are killed at the deadline (HypoFuzz's workers skip ``atexit``).
An interrupt (SIGINT) stops the machine at its next step even when it first lands where
Python loses it (below).
"""

import atexit
import os
import signal
from pathlib import Path
from types import FrameType

from hypothesis.stateful import RuleBasedStateMachine, invariant

from tests.support.host_lockstep import HostTierMachine, WindowedHostTierMachine
from tests.support.lockstep import AllocatorMachine, WindowedAllocatorMachine
from tests.support.metamorphic import (
    ForkReleaseLeavesTheCache,
    HostTierAddsHits,
    LargerPoolKeepsHits,
    ResetIsAFreshPool,
    SaltNeverRaisesHits,
)
from tests.support.planted_bugs import WeakHashOnly
from tests.support.stream_consumers import ConsumersMachine


class Tally:
    """Test cases finished and invariant checks run (one after init, one after each step)."""

    cases = 0
    checks = 0

    @classmethod
    def steps(cls) -> int:
        return cls.checks - cls.cases


class Tallied(RuleBasedStateMachine):
    """Put first among a machine's bases: it tallies the machine's test cases and steps
    (the conformance kit's fuzz target uses it too)."""

    @invariant()
    def count_a_check(self) -> None:
        Tally.checks += 1
        if _Interrupt.requested:
            raise KeyboardInterrupt("SIGINT (first lost in a callback)")

    def teardown(self) -> None:
        Tally.cases += 1
        if Tally.cases % 10 == 0:
            _write_tally()
        super().teardown()


class CountingAllocatorMachine(Tallied, AllocatorMachine):
    """``AllocatorMachine`` that tallies its test cases and steps."""


class CountingWeakHashMachine(CountingAllocatorMachine):
    """The same under a hash that collides all the time: the paths prefix hits take when
    a bucket holds several blocks, which the default hash almost never produces."""

    target_class = WeakHashOnly


class CountingWindowedMachine(CountingAllocatorMachine, WindowedAllocatorMachine):
    """The same on pools shared by KV cache groups with sliding windows."""


class CountingHostTierMachine(Tallied, HostTierMachine):
    """The machine with a host tier: swap out and in, the copies, the host prefix cache."""


class CountingWindowedHostTierMachine(Tallied, WindowedHostTierMachine):
    """The same on pools of KV cache groups with sliding windows."""


def _tallied(machine: type[RuleBasedStateMachine]) -> type[RuleBasedStateMachine]:
    """``machine`` that tallies its test cases and steps."""
    return type(f"Counting{machine.__name__}", (Tallied, machine), {})


TestFuzzImplAgreesWithSpec = CountingAllocatorMachine.TestCase
TestFuzzImplUnderAWeakHashAgreesWithSpec = CountingWeakHashMachine.TestCase
TestFuzzImplWithWindowsAgreesWithSpec = CountingWindowedMachine.TestCase
TestFuzzImplWithAHostTierAgreesWithSpec = CountingHostTierMachine.TestCase
TestFuzzImplWithAHostTierAndWindowsAgreesWithSpec = CountingWindowedHostTierMachine.TestCase
TestFuzzAHostTierAddsHits = _tallied(HostTierAddsHits).TestCase
TestFuzzALargerPoolKeepsHits = _tallied(LargerPoolKeepsHits).TestCase
TestFuzzASaltNeverRaisesHits = _tallied(SaltNeverRaisesHits).TestCase
TestFuzzAForkReleasedAtOnceLeavesTheCache = _tallied(ForkReleaseLeavesTheCache).TestCase
TestFuzzAResetIsAFreshPool = _tallied(ResetIsAFreshPool).TestCase
TestFuzzAConsumerOfTheStreamHoldsTheCachesKeys = _tallied(ConsumersMachine).TestCase


def _write_tally() -> None:
    directory = os.environ.get("PAGEDKV_FUZZ_TALLY")
    if directory and Tally.cases:
        tally = Path(directory) / f"{os.getpid()}.txt"
        tally.write_text(f"cases={Tally.cases} steps={Tally.steps()}\n", encoding="utf-8")


class _Interrupt:
    requested = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _Interrupt.requested = True
    raise KeyboardInterrupt


atexit.register(_write_tally)
# NOTE: a command started with ``&`` by a non-interactive shell (each scripts/fuzz.sh
# worker) inherits SIGINT ignored, and Python then leaves it ignored: the deadline's
# interrupt did nothing and the worker was killed hard 60 s later, its tally unwritten.
# A handler of our own turns the interrupt into KeyboardInterrupt, so pytest stops at the
# deadline, reports, and the tally is written at exit.
# NOTE: and it remembers the interrupt. Python runs the handler in whatever Python code
# runs next, and when that is a garbage-collector callback (Hypothesis registers one that
# times each collection, and generation collects often) or a finalizer, the
# KeyboardInterrupt is "ignored" there and fuzzing goes on: ~20 s into a run at load 6,
# one SIGINT in three was lost that way (the worker then killed 10 s later, its output
# gone). The next step's check raises it again.
signal.signal(signal.SIGINT, _interrupt)
