"""The lockstep state machine on hybrid pools (a state group beside attention groups),
on the real impl and on the state group's planted bugs."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from impl import KVCacheManager
from tests.allocator.test_allocator_state_machine import CATCHING
from tests.support.lockstep import HybridAllocatorMachine, machine_for
from tests.support.state_planted_bugs import STATE_PLANTED_BUGS

TestImplWithAStateGroupAgreesWithSpec = HybridAllocatorMachine.TestCase
TestImplWithAStateGroupAgreesWithSpec.settings = settings(
    TestImplWithAStateGroupAgreesWithSpec.settings, max_examples=150
)


@pytest.mark.parametrize("broken", STATE_PLANTED_BUGS, ids=lambda cls: cls.__name__)
def test_hybrid_state_machine_catches_planted_state_bug(broken: type[KVCacheManager]) -> None:
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine_for(broken, HybridAllocatorMachine), settings=CATCHING)
