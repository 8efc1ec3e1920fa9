#!/usr/bin/env bash
# Long fuzzing of the lockstep state machine on every core: the plain path, always there.
#
#   scripts/fuzz.sh [--target NAME] [--database URL] [SECONDS] [WORKERS]
#                                             (defaults: 3600 s, one worker per core)
#
# With --target, the workers fuzz the conformance kit's machine on that target instead
# (tests/conformance/fuzz_conformance.py; NAME as `python -m harness.conformance --help`).
# With --database redis://HOST:PORT/N, failing cases are also saved to and replayed from
# that Redis (Hypothesis' RedisExampleDatabase, the 'cluster' extra), so runs on other
# machines pointing at it replay them; it must answer and hold this Hypothesis version's
# examples, or the script refuses before starting. Should Redis stop answering later, one
# line says so and every worker goes on with the local database alone (the run's exit
# status stays that of its workers). (`pagedkv fuzz --ray` runs the workers on a Ray
# cluster instead, with a tally in Redis.)
#
# Each worker runs pytest on tests/support/fuzz_targets.py under the `fuzz` Hypothesis profile
# (many cases, at most 100 steps each, no explain phase), Hypothesis drawing a fresh random
# seed each time, again and again until the time is up. Failing cases land in the local
# example database .hypothesis/fuzz-db, so `pagedkv fuzz --replay` there replays them; paste
# each one into tests/allocator/test_regressions.py, since saved cases do not survive a
# Hypothesis upgrade.
# At the end, the saved cases are replayed (python -m harness.cluster.replay, the replay of
# `pagedkv fuzz --replay` and of each Ray worker): a failure found as the time ran out is
# still being shrunk at the interrupt and reported by no worker, but it is saved.
# Logs and tallies go to .hypothesis/fuzz-logs/. Exits 1 if any worker found a failure, or
# a saved case fails on that replay.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
fuzz_file=tests/support/fuzz_targets.py
target=allocator
database=
options=()  # as given, for the replay hint
while [ "$#" -gt 0 ]; do
    case "$1" in
    --target)
        python -c 'import sys; from harness.conformance.targets import TARGETS; sys.exit(sys.argv[1] not in TARGETS)' "${2:-}" ||
            { echo "fuzz: unknown conformance target '${2:-}'" >&2; exit 2; }
        export PAGEDKV_CONFORMANCE_TARGET=$2
        fuzz_file=tests/conformance/fuzz_conformance.py
        target="conformance target $2"
        options+=("$1" "$2")
        shift 2
        ;;
    --database)
        python -m harness.cluster.shared_database "${2:-}" || exit 2
        export PAGEDKV_FUZZ_DATABASE=$2
        database=$2
        options+=("$1" "$2")
        shift 2
        ;;
    *) break ;;
    esac
done
seconds=${1:-3600}
workers=${2:-$(nproc)}
logs=.hypothesis/fuzz-logs/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$logs/tally"

# The targets (test classes) of the fuzz file, in file order; each worker's run takes them
# all, starting at a different one (``rotated N``: from target N mod their count on), so
# every target is fuzzed from the first minutes, whatever the number of workers.
mapfile -t targets < <(python -m pytest -q --collect-only -p no:cacheprovider "$fuzz_file" | grep '::')
rotated() {
    local start=$(($1 % ${#targets[@]}))
    printf '%s\n' "${targets[@]:start}" "${targets[@]:0:start}"
}

fuzz_worker() {
    local worker=$1 deadline=$(($(date +%s) + seconds)) left status run=0
    while left=$((deadline - $(date +%s))); [ "$left" -gt 0 ]; do
        run=$((run + 1))
        echo "== worker $worker run $run, ${left}s left, from $(rotated $((worker + run)) | head -1)" \
            >>"$logs/worker-$worker.log"
        status=0
        # No --hypothesis-seed: Hypothesis draws a fresh seed for each process, and a
        # forced seed would turn its example database off (no failure saved, none replayed).
        # SIGINT, not SIGTERM, at the deadline: pytest then stops cleanly and the tally
        # is written (fuzz_targets.py re-enables SIGINT, which a background job inherits
        # ignored). -k 60 is the last resort should a worker still hang. --foreground keeps
        # pytest in the script's process group, so stopping that group stops every worker
        # (`pagedkv fuzz` does on Ctrl-C).
        PAGEDKV_FUZZ_TALLY="$logs/tally" HYPOTHESIS_PROFILE=fuzz \
            timeout --foreground -s INT -k 60 "$left" \
            python -m pytest -q -x -p no:cacheprovider $(rotated $((worker + run))) \
            >>"$logs/worker-$worker.log" 2>&1 || status=$?
        # 0: a run finished. 124, or 137 once the hard kill came: the deadline.
        if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && [ "$status" -ne 137 ]; then
            echo "worker $worker: FAILURE in run $run (see $logs/worker-$worker.log)" >&2
            return 1
        fi
    done
}

echo "fuzz: $workers worker(s) for ${seconds}s on the $target, logs in $logs" >&2
started=$(date +%s)
watcher=
if [ -n "$database" ]; then
    # One line if Redis stops answering (each pytest process then goes on without it).
    python -m harness.cluster.shared_database --watch "$database" "$started" &
    watcher=$!
fi
pids=()
for worker in $(seq 1 "$workers"); do
    fuzz_worker "$worker" &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
if [ -n "$watcher" ]; then
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
fi
tallies=("$logs"/tally/*.txt)
if [ ! -e "${tallies[0]}" ]; then
    # No pytest process got as far as writing its tally (the time ran out during
    # collection, or pytest could not start): nothing was fuzzed, which is not a pass.
    echo "fuzz: no worker finished a test run in ${seconds}s, so nothing was fuzzed (see $logs/worker-*.log)" >&2
    exit 1
fi
awk -v workers="$workers" -v wall=$(($(date +%s) - started)) '
    { split($1, c, "="); split($2, s, "="); cases += c[2]; steps += s[2]; runs += 1 }
    END { printf "fuzz: %d worker(s), %d s, %d process(es), %d test cases, %d steps\n",
          workers, wall, runs, cases, steps }' "${tallies[@]}" | tee "$logs/summary.txt"
if [ "$failed" -eq 0 ]; then
    # A failure found shortly before the deadline is still being shrunk at the interrupt,
    # and pytest reports nothing; Hypothesis has saved it in the database as it shrank.
    # So replay what is saved (seconds: nothing is generated; killed at 120 s, status 124):
    # it fails if such a case, or an older one that still fails, is there.
    status=0
    python -m harness.cluster.replay "$fuzz_file" --timeout 120 \
        ${PAGEDKV_FUZZ_DATABASE:+--database "$PAGEDKV_FUZZ_DATABASE"} \
        >"$logs/replay.log" 2>&1 || status=$?
    if [ "$status" -eq 1 ]; then
        grep '^FAILED ' "$logs/replay.log" >&2 || true
        echo "fuzz: a saved case fails on replay (found as the time ran out, or before; see $logs/replay.log)" >&2
        failed=1
    fi
fi
if [ "$failed" -ne 0 ]; then
    echo "fuzz: a failure was found; replay it with: pagedkv fuzz --replay ${options[*]} (it is in .hypothesis/fuzz-db)" >&2
    exit 1
fi
