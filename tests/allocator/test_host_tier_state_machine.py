"""The lockstep state machine with a host tier, on the real impl (the host-tier planted
bugs run in ``test_allocator_state_machine.py``, beside the others)."""

from tests.support.host_lockstep import HostTierMachine, WindowedHostTierMachine

TestImplWithAHostTierAgreesWithSpec = HostTierMachine.TestCase
TestImplWithAHostTierAndWindowsAgreesWithSpec = WindowedHostTierMachine.TestCase
