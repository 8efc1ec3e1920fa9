"""The conformance kit: pagedkv's spec as an oracle for the block allocators people ship.

Wrap an allocator in an ``Adapter`` (the spec's operations, what the target shows) or a
server's scheduler in an ``EngineAdapter`` (whole engine steps, each allocator call
reported), then ``assert_conforms(factory)`` from a test suite, or ``python -m
harness.conformance --target NAME`` (a bundled target, or ``package.module:factory``).
A broken adapter is refused before the first step (``AdapterError``). Needs Hypothesis,
not torch. See docs/conformance.md for the properties, the adapter contract and the
targets.
"""

from harness.conformance.adapter import (
    CACHE_SALT,
    OPERATION_NAMES,
    Adapter,
    Call,
    EngineAdapter,
    Observation,
    Outcome,
    TargetTable,
)
from harness.conformance.machine import ConformanceMachine, machine_for
from harness.conformance.report import DiscrepancyError, Report
from harness.conformance.run import assert_conforms, check_target
from harness.conformance.validate import AdapterError

__all__ = [
    "CACHE_SALT",
    "OPERATION_NAMES",
    "Adapter",
    "AdapterError",
    "Call",
    "ConformanceMachine",
    "DiscrepancyError",
    "EngineAdapter",
    "Observation",
    "Outcome",
    "Report",
    "TargetTable",
    "assert_conforms",
    "check_target",
    "machine_for",
]
