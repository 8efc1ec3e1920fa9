"""Hypothesis' shrunk steps read out of pytest's report, in both of the shapes it takes
(the excerpts are from real fuzz worker logs, Hypothesis 6.170.15, pytest 9.2.0)."""

from harness.cluster.failures import failed_tests, shrunk_steps

ONE_FAILURE = """\
>       assert self.target.free_blocks == self.target.total_blocks, "a block leaked"
               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
E       AssertionError: a block leaked
E       Failing test case: <state machine>
E       state = CountingRefusedAllocateMachine()
E       state.init_pool(total_blocks=1, block_size=1)
E       state.allocate(request_id='r0', token_count=2)
E       state.teardown()
E
E       You can reproduce this test case by temporarily adding @reproduce_failure(...)

tests/support/lockstep.py:384: AssertionError
=========================== short test summary info ============================
FAILED tests/cluster/planted_fuzz_target.py::TestFuzzRefusedAllocateTakesBlocks::runTest
"""

TWO_DISTINCT_FAILURES = """\
  | ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)
  +-+---------------- 1 ----------------
    |     assert self.target.to_spec() == self.model
    | AssertionError
    | Failing test case: <state machine>
    | state = CountingLeakyMachine()
    | state.init_pool(total_blocks=1, block_size=1)
    | state.release(request_id='r0')
    | state.teardown()
    |
    +---------------- 2 ----------------
    | AssertionError: a block leaked
    | Failing test case: <state machine>
    | state = CountingLeakyMachine()
    | state.init_pool(total_blocks=1, block_size=1)
    | state.teardown()
    +------------------------------------
FAILED tests/cluster/planted_fuzz_target.py::TestFuzzPlantedLeak::runTest - E...
"""


def test_the_error_and_the_steps_of_one_failure() -> None:
    assert shrunk_steps(ONE_FAILURE) == [
        "AssertionError: a block leaked\n"
        "state = CountingRefusedAllocateMachine()\n"
        "state.init_pool(total_blocks=1, block_size=1)\n"
        "state.allocate(request_id='r0', token_count=2)\n"
        "state.teardown()"
    ]
    assert failed_tests(ONE_FAILURE) == [
        "tests/cluster/planted_fuzz_target.py::TestFuzzRefusedAllocateTakesBlocks::runTest"
    ]


def test_each_of_several_distinct_failures_in_an_exception_group() -> None:
    assert shrunk_steps(TWO_DISTINCT_FAILURES) == [
        "AssertionError\n"
        "state = CountingLeakyMachine()\n"
        "state.init_pool(total_blocks=1, block_size=1)\n"
        "state.release(request_id='r0')\n"
        "state.teardown()",
        "AssertionError: a block leaked\n"
        "state = CountingLeakyMachine()\n"
        "state.init_pool(total_blocks=1, block_size=1)\n"
        "state.teardown()",
    ]
    assert failed_tests(TWO_DISTINCT_FAILURES) == [
        "tests/cluster/planted_fuzz_target.py::TestFuzzPlantedLeak::runTest"
    ]


def test_no_steps_in_a_run_that_failed_elsewhere() -> None:
    assert shrunk_steps("E   ImportError: no module named nope\nFAILED t.py::test_x\n") == []
