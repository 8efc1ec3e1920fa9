"""The conformance machine as a long-fuzzing target: ``scripts/fuzz.sh --target NAME``.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``).
``PAGEDKV_CONFORMANCE_TARGET`` names a target of ``harness.conformance.targets.TARGETS``;
each of its configurations becomes a test case run under the loaded Hypothesis profile
(``fuzz``: its example database keeps failures), tallied as ``scripts/fuzz.sh`` expects.
"""

import os

from hypothesis.stateful import invariant

from harness.conformance import ConformanceMachine, machine_for
from harness.conformance.targets import CONFIGURATIONS, TARGETS
from tests.support.fuzz_targets import Tally, _write_tally


def _counting(base: type[ConformanceMachine]) -> type[ConformanceMachine]:
    class CountingConformanceMachine(base):  # type: ignore[valid-type,misc]
        @invariant()
        def count_a_check(self) -> None:
            Tally.checks += 1

        def teardown(self) -> None:
            Tally.cases += 1
            if Tally.cases % 10 == 0:
                _write_tally()
            super().teardown()

    return CountingConformanceMachine


for _name in TARGETS[os.environ.get("PAGEDKV_CONFORMANCE_TARGET", "pagedkv")]:
    globals()[f"TestFuzz_{_name.replace('-', '_')}"] = _counting(
        machine_for(CONFIGURATIONS[_name])
    ).TestCase
