#!/usr/bin/env bash
# Symbolic comparison of the spec's arithmetic helpers with the impl's (CrossHair).
#
#   scripts/crosshair_check.sh [SECONDS_PER_PAIR]      (default 120)
#
# Each pair in tests/support/helper_pairs.py goes to `crosshair diffbehavior`, exceptions compared
# by type and message. "All paths exhausted" means every path within the wrappers' bounds
# was explored; "No differences found" without it means the time ran out first. Exits 1 on
# a difference. Kept out of the state machine: there it is far slower and weaker than
# plain Hypothesis.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
seconds=${1:-120}
python -c "import crosshair" 2>/dev/null || python -m pip install --quiet crosshair-tool==0.0.113
status=0
for pair in blocks_for_tokens slot_of_next_token next_token_opens_a_block; do
    echo "== $pair (spec vs impl, at most ${seconds}s)"
    timeout -k 10 $((seconds * 3)) crosshair diffbehavior \
        --exception_equivalence TYPE_AND_MESSAGE --per_condition_timeout "$seconds" \
        "tests.support.helper_pairs.spec_$pair" "tests.support.helper_pairs.impl_$pair" || status=1
done
exit "$status"
