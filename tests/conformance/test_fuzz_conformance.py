"""The conformance fuzz target files each configuration's saved examples apart: a failure
found on one configuration must not replay (and, passing there, be deleted) on another,
least of all in a database that every fuzz worker shares."""

from hypothesis.internal.reflection import function_digest

from harness.conformance.targets import CONFIGURATIONS
from tests.conformance.fuzz_conformance import counting


def test_each_configuration_has_its_own_example_database_key() -> None:
    # Hypothesis keys a state machine's examples by function_digest of the machine class.
    keys = {function_digest(counting(name)) for name in CONFIGURATIONS}
    assert len(keys) == len(CONFIGURATIONS)
