#!/usr/bin/env bash
# Mutation testing of spec/ and impl/ with mutmut 3 (settings: the [mutmut] section of
# setup.cfg; its work tree is mutants/, git-ignored).
#
#   scripts/mutation.sh [MUTANT_NAME_OR_GLOB ...]     (default: every mutant)
#
# Runs on every core under the `mutation` Hypothesis profile (the deterministic `ci` one
# without shrinking), so a mutant's verdict does not depend on luck and a killed mutant
# is not shrunk. mutmut keeps verdicts in mutants/ and checks only the
# mutants it has no verdict for, so an interrupted run picks up where it stopped; delete
# mutants/ for a run from scratch. Prints the score and the surviving mutants, and exits 1
# if any survived: each survivor is either killed by a new test or explained as
# equivalent in docs/verification.md. Bounded by MUTATION_SECONDS (default 3600).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -c 'import mutmut' 2>/dev/null || python -m pip install --quiet mutmut==3.8.1
mkdir -p mutants
status=0
CI=true HYPOTHESIS_PROFILE=mutation timeout -k 10 "${MUTATION_SECONDS:-3600}" \
    mutmut run --max-children "$(nproc)" "$@" >mutants/run.log 2>&1 || status=$?
mutmut export-cicd-stats >/dev/null
python - <<'PY'
import json

stats = json.load(open("mutants/mutmut-cicd-stats.json"))
checked = stats["killed"] + stats["survived"] + stats["timeout"] + stats["suspicious"]
killed = stats["killed"] + stats["timeout"]
print(f"mutation: {checked} of {stats['total']} mutants checked, {killed} killed "
      f"({stats['timeout']} by timeout), {stats['survived']} survived, "
      f"{stats['no_tests']} without tests; score {killed / max(checked, 1):.1%}")
PY
survivors=$(mutmut results | grep -E ': (survived|no tests)$' || true)
if [ -n "$survivors" ]; then
    echo "$survivors"
    status=1
fi
exit "$status"
