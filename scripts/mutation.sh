#!/usr/bin/env bash
# Mutation testing of spec/ and impl/ with mutmut 3 (settings: the [mutmut] section of
# setup.cfg; its work tree is mutants/, git-ignored).
#
#   scripts/mutation.sh [MUTANT_NAME_OR_GLOB ...]     (default: every mutant)
#
# Runs on every core under the `mutation` Hypothesis profile (the deterministic `ci` one
# without shrinking), so a mutant's verdict does not depend on luck and a killed mutant
# is not shrunk; a mutant that mypy --strict rejects is killed without a test (setup.cfg).
# With no names:
# - the mutants no test can kill are listed in mutants/equivalent.txt and not run: two
#   classes read from their diff (zip's strict loosened, an assert's message changed) and
#   those explained one by one in scripts/mutation_equivalent.txt while their function is
#   unchanged (scripts/mutation_classes.py; each shown equivalent in docs/verification.md);
#   each would run every test that reaches its function, as a survivor does;
# - verdicts saved in scripts/mutation_verdicts.txt (commit it) go back to the mutants of
#   functions unchanged since (scripts/mutation_verdicts.py), in any checkout: a run of
#   every mutant takes longer than a session on the 2-core machine;
# - only mutants without a verdict run, so a stopped run picks up where it stopped;
# - a test edited since mutmut mapped the tests to functions is mapped again
#   (scripts/mutation_stale_tests.py), so an assertion added to kill a survivor runs.
# Delete mutants/ and the verdicts file for a run from scratch. Prints the score and the
# surviving mutants, and exits 1 if any survived: each survivor is either killed by a new
# test or explained as equivalent in docs/verification.md. Bounded by MUTATION_SECONDS
# (default 3600).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p mutants
if [ $# -eq 0 ]; then
    python scripts/mutation_classes.py --generate >/dev/null
    python scripts/mutation_verdicts.py restore
    python scripts/mutation_classes.py --to-run mutants/to-run.txt >mutants/equivalent.txt
    tail -n 1 mutants/equivalent.txt
    mapfile -t names <mutants/to-run.txt
    set -- "${names[@]}"
fi
status=0
if [ $# -gt 0 ]; then
    python scripts/mutation_stale_tests.py
    CI=true HYPOTHESIS_PROFILE=mutation timeout -k 10 "${MUTATION_SECONDS:-3600}" \
        mutmut run --max-children "$(nproc)" "$@" >mutants/run.log 2>&1 || status=$?
fi
python scripts/mutation_verdicts.py save
python scripts/mutation_classes.py --summary
touch mutants/equivalent.txt
survivors=$(mutmut results | grep -E ': (survived|no tests)$' \
    | grep -vwF -f <(sed -n 's/^[a-z-]*: //p' mutants/equivalent.txt) || true)
if [ -n "$survivors" ]; then
    echo "$survivors"
    status=1
fi
exit "$status"
