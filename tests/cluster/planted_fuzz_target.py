"""A fuzz target with a planted bug, for the cluster fuzzing tests: the lockstep machine on
``LeaksOneBlockOnRelease`` (a release forgets to return the request's last block), tallied
as ``scripts/fuzz.sh``'s targets are. Any allocate followed by a release shows it: found
within the first ten test cases here, shrunk in 2-12 s (a subtler bug, a refused allocate
keeping its blocks, went unfound for 540 cases on a loaded machine).

Not collected by a plain ``pytest`` run (the name does not start with ``test_``): the tests
hand its path to the workers, as ``scripts/fuzz.sh`` names its targets.
"""

from tests.support.fuzz_targets import Tallied
from tests.support.lockstep import machine_for
from tests.support.planted_bugs import LeaksOneBlockOnRelease


class CountingLeakOnReleaseMachine(Tallied, machine_for(LeaksOneBlockOnRelease)):  # type: ignore[misc]
    """The lockstep machine on an allocator whose release leaks a block."""


TestFuzzLeaksOneBlockOnRelease = CountingLeakOnReleaseMachine.TestCase
