"""The conformance kit: pagedkv's spec as an oracle for the block allocators people ship.

Wrap an allocator in an ``Adapter`` (the spec's operations, what the target shows), then
``assert_conforms(factory)`` from a test suite, or ``python -m harness.conformance --target
NAME`` for the bundled targets. See docs/conformance.md for the properties and the targets.
"""

from harness.conformance.adapter import OPERATION_NAMES, Adapter, Observation, TargetTable
from harness.conformance.machine import ConformanceMachine, machine_for
from harness.conformance.report import DiscrepancyError, Report
from harness.conformance.run import assert_conforms, check_target

__all__ = [
    "OPERATION_NAMES",
    "Adapter",
    "ConformanceMachine",
    "DiscrepancyError",
    "Observation",
    "Report",
    "TargetTable",
    "assert_conforms",
    "check_target",
    "machine_for",
]
