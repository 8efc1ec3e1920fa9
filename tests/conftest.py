"""Hypothesis profiles for pagedkv's property and state-machine tests.

Pick one with ``pytest --hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``:
- ``ci``: bounded and deterministic (derandomized), prints the replay blob of a failure;
  the default when the ``CI`` environment variable is set.
- ``dev``: the default elsewhere; random, keeps failures in ``.hypothesis/``.
- ``mutation``: ``ci`` without shrinking, for ``scripts/mutation.sh``: a mutant is killed
  by the first failing example; shrinking it (slow when the mutant makes the impl slow)
  would only spend the mutant's time limit.
- ``fuzz``: for long sessions; many examples, no deadline, at most 100 steps a case and
  no explain phase (longer cases made shrinking take minutes and still not minimal).
  Examples that fail are kept in a local directory database (``.hypothesis/fuzz-db``),
  layered over a shared Redis one when a fuzz worker names it
  (``harness.cluster.shared_database``).
- ``fuzz-replay``: ``fuzz``'s saved failures only, no generation or shrinking, the shared
  database read-only (``pagedkv fuzz --replay``).

Our ``ci`` profile replaces Hypothesis' built-in one of the same name, which Hypothesis
would otherwise load on its own when ``CI`` is set.
"""

import json
import os

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings

from harness.cluster.shared_database import fuzz_database

# The Triton kernel's tests run it on CPU tensors, in Triton's interpreter: a mode fixed
# when a process first imports triton, so it is set here, before any test imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutation",
    settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    report_multiple_bugs=False,
)
settings.register_profile(
    "dev",
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
)
settings.register_profile(
    "fuzz",
    max_examples=2_000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    database=fuzz_database(os.environ),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
    verbosity=Verbosity.normal,
)
settings.register_profile(
    "fuzz-replay",
    settings.get_profile("fuzz"),
    database=fuzz_database(os.environ, read_only=True),
    phases=[Phase.explicit, Phase.reuse],
)

_default_profile = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default_profile))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under mutmut, run a mutant's tests fastest first (``scripts/mutation.sh``).

    mutmut hands pytest a mutant's tests as a set, so in any order, and stops at the first
    failure (``-x``): most mutants of the functions every test reaches are killed by many
    tests, so taking the quick ones first ends a killed mutant in seconds rather than after
    minutes of slow walks. The verdict is the same in any order (the tests share no
    state); only the time to it changes. The durations are those of mutmut's stats run.
    """
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    try:
        with open("mutmut-stats.json") as stats:
            seconds: dict[str, float] = json.load(stats)["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: seconds.get(item.nodeid, float("inf")))
