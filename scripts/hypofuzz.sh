#!/usr/bin/env bash
# Coverage-guided fuzzing of the lockstep state machine with HypoFuzz (`hypothesis fuzz`).
#
#   scripts/hypofuzz.sh [SECONDS] [WORKERS]     (defaults: 600 s, one worker per core)
#
# HypoFuzz is free for non-commercial use only (see its licence); scripts/fuzz.sh is the
# plain path and stays first-class. It is not a project dependency: install it with
# `pip install hypofuzz==25.11.1`. It runs forever on its own, so it is bounded here;
# failures land in the `fuzz` profile's database (.hypothesis/fuzz-db), as with fuzz.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
workers=${2:-$(nproc)}
logs=.hypothesis/hypofuzz-logs/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$logs/tally"
. .venv/bin/activate
echo "hypofuzz: $workers worker(s) for ${seconds}s, log in $logs/hypofuzz.log" >&2
status=0
PAGEDKV_FUZZ_TALLY="$logs/tally" HYPOTHESIS_PROFILE=fuzz \
    timeout -s INT -k 10 "$seconds" \
    hypothesis fuzz --no-dashboard -n "$workers" -- tests/support/fuzz_targets.py \
    >"$logs/hypofuzz.log" 2>&1 || status=$?
cat "$logs"/tally/*.txt 2>/dev/null | awk -v workers="$workers" -v seconds="$seconds" '
    { split($1, c, "="); split($2, s, "="); cases += c[2]; steps += s[2] }
    END { printf "hypofuzz: %d worker(s), %d s, %d test cases, %d steps\n",
          workers, seconds, cases, steps }' | tee "$logs/summary.txt"
# 124: the deadline came, the normal end of a bounded session.
if [ "$status" -ne 124 ]; then
    echo "hypofuzz: stopped with status $status before the deadline (see the log)" >&2
    exit 1
fi
