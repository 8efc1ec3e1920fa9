"""A fuzz target with a planted bug, for the cluster fuzzing tests: the lockstep machine on
``RefusedAllocateTakesBlocks`` (an allocate refused for want of blocks keeps the blocks it
took), tallied as ``scripts/fuzz.sh``'s targets are. Under the ``fuzz`` profile a worker
finds and shrinks it in a few seconds (100-150 test cases).

Not collected by a plain ``pytest`` run (the name does not start with ``test_``): the tests
hand its path to the workers, as ``scripts/fuzz.sh`` names its targets.
"""

from tests.support.fuzz_targets import Tallied
from tests.support.lockstep import machine_for
from tests.support.planted_bugs import RefusedAllocateTakesBlocks


class CountingRefusedAllocateMachine(Tallied, machine_for(RefusedAllocateTakesBlocks)):  # type: ignore[misc]
    """The lockstep machine on an allocator whose refused allocate leaks what it took."""


TestFuzzRefusedAllocateTakesBlocks = CountingRefusedAllocateMachine.TestCase
