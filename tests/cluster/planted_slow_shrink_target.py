"""A fuzz target whose first failure cannot be shrunk before any deadline, for
``test_worker.py``: it fails on every input, and under the ``fuzz`` profile every run after
its first failing one hangs (Hypothesis' shrinking, then its final replay of the failure).
So the search's pytest is interrupted at the deadline having reported nothing, while the
failing example is already in the database; a replay (the ``fuzz-replay`` profile) fails at
once.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``).
"""

import os
import time

from hypothesis import given
from hypothesis import strategies as st

# The fuzz targets' SIGINT handler: pytest stops at the deadline's interrupt even where it
# was started with SIGINT ignored.
import tests.support.fuzz_targets  # noqa: F401

_FAILED = [False]


@given(st.integers())
def test_fails_and_shrinks_past_any_deadline(x: int) -> None:
    if _FAILED[0] and os.environ.get("HYPOTHESIS_PROFILE") == "fuzz":
        time.sleep(3600)
    _FAILED[0] = True
    raise AssertionError(f"planted: fails for every x ({x})")
