"""The conformance machine as a long-fuzzing target: ``scripts/fuzz.sh --target NAME``.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``).
``PAGEDKV_CONFORMANCE_TARGET`` names a target of ``harness.conformance.targets.TARGETS``;
each of its configurations becomes a test case run under the loaded Hypothesis profile
(``fuzz``: its example database keeps failures), tallied as ``scripts/fuzz.sh`` expects.
The targets' findings (docs/findings/) are declared: fuzzing looks for new bugs.
"""

import os

from harness.conformance import ConformanceMachine, machine_for
from harness.conformance.targets import TARGETS, configuration
from tests.support.fuzz_targets import Tallied


def _counting(base: type[ConformanceMachine]) -> type[ConformanceMachine]:
    class CountingConformanceMachine(Tallied, base):  # type: ignore[valid-type,misc]
        """The target's conformance machine, tallied as ``scripts/fuzz.sh`` expects."""

    return CountingConformanceMachine


for _name in TARGETS[os.environ.get("PAGEDKV_CONFORMANCE_TARGET", "pagedkv")]:
    globals()[f"TestFuzz_{_name.replace('-', '_')}"] = _counting(
        machine_for(configuration(_name, known_findings=True))
    ).TestCase
