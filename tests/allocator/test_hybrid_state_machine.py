"""The lockstep state machine on hybrid pools (a state group beside attention groups),
on the real impl and on the state group's planted bugs."""

from hypothesis import settings

from tests.support.lockstep import HybridAllocatorMachine

TestImplWithAStateGroupAgreesWithSpec = HybridAllocatorMachine.TestCase
TestImplWithAStateGroupAgreesWithSpec.settings = settings(
    TestImplWithAStateGroupAgreesWithSpec.settings, max_examples=150
)
