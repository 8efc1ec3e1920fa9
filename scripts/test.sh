#!/usr/bin/env bash
# The test command: set up .venv, then type-check, lint and run every test.
# Hypothesis runs the deterministic `ci` profile unless HYPOTHESIS_PROFILE says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
echo "== mypy --strict" >&2
mypy
echo "== ruff" >&2
scripts="scripts/gpu_check.py scripts/mutation_classes.py scripts/mutation_verdicts.py"
ruff check spec impl harness tests $scripts
ruff format --check spec impl harness tests $scripts
echo "== pytest" >&2
# On every core (pytest-xdist; PYTEST_WORKERS=0 runs in this process); a worker that is idle
# takes over queued tests from a busy one.
python -m pytest -q -n "${PYTEST_WORKERS:-auto}" --dist worksteal \
    --hypothesis-profile="${HYPOTHESIS_PROFILE:-ci}" "$@"
