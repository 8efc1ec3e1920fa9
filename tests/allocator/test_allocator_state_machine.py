"""The lockstep state machine, on the real impl and on every planted bug."""

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from impl import KVBlockManager
from tests.support.lockstep import AllocatorMachine, machine_for
from tests.support.planted_bugs import PLANTED_BUGS, QUERY_BUGS, WeakHashOnly

TestImplAgreesWithSpec = AllocatorMachine.TestCase
# Under a hash that collides all the time, hits must still be exactly the spec's.
TestImplUnderAWeakHashAgreesWithSpec = machine_for(WeakHashOnly).TestCase


@pytest.mark.parametrize("broken", PLANTED_BUGS + QUERY_BUGS, ids=lambda cls: cls.__name__)
def test_state_machine_catches_planted_bug(broken: type[KVBlockManager]) -> None:
    # Derandomized and without a database: the catch must not depend on luck or history.
    # No shrinking: that the machine fails is the point here, not the smallest failure.
    catching = settings(
        max_examples=300,
        derandomize=True,
        database=None,
        deadline=None,
        report_multiple_bugs=False,
        phases=[Phase.generate],
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine_for(broken), settings=catching)
