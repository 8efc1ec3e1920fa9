"""The conformance machine as a long-fuzzing target: ``scripts/fuzz.sh --target NAME``.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``).
``PAGEDKV_CONFORMANCE_TARGET`` names a target of ``harness.conformance.targets.TARGETS``;
each of its configurations becomes a test case run under the loaded Hypothesis profile
(``fuzz``: its example database keeps failures), tallied as ``scripts/fuzz.sh`` expects.
The targets' findings (docs/findings/) are declared: fuzzing looks for new bugs.
"""

import os
from typing import cast

from harness.conformance import ConformanceMachine, machine_for
from harness.conformance.targets import TARGETS, configuration
from tests.support.fuzz_targets import Tallied


def counting(name: str) -> type[ConformanceMachine]:
    """Configuration ``name``'s conformance machine, tallied as ``scripts/fuzz.sh`` expects."""
    # NOTE: made by type(), not by a class statement in a function. Hypothesis files a state
    # machine's saved examples under a digest of its class's source; one class statement
    # gave every configuration the same source, so a failure saved for one was replayed on
    # the others (and, passing there, deleted). A class without source is filed by name.
    machine = type(
        f"CountingConformanceMachine_{name}",
        (Tallied, machine_for(configuration(name, known_findings=True))),
        {},
    )
    return cast("type[ConformanceMachine]", machine)


for _name in TARGETS[os.environ.get("PAGEDKV_CONFORMANCE_TARGET", "pagedkv")]:
    globals()[f"TestFuzz_{_name.replace('-', '_')}"] = counting(_name).TestCase
