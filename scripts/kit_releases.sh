#!/usr/bin/env bash
# The conformance kit on the newest releases of its real targets, beside the pinned ones.
#
#   scripts/kit_releases.sh [STEPS] [VLLM_VERSION] [TRANSFORMERS_VERSION]
#       (defaults: 20000 steps a target; the newest vllm and transformers on the registry)
#
# The pinned versions (pyproject.toml's 'harness' and 'conformance' extras) are what CI and
# .venv run. This makes one environment per pair of releases, .venv-kit/vllm-V_transformers-T
# (git-ignored; made once: the same packages as .venv with those two versions instead, vLLM
# without its dependencies as scripts/setup.sh installs it), then runs
# `python -m harness.conformance --known-findings` on each real target there: vllm (full and
# hybrid), vllm-mamba and transformers. --known-findings counts each finding of
# docs/findings/ instead of stopping at it, so the summary says, per target, whether each
# finding is still seen on that release; any other discrepancy stops the run and fails this
# script (exit 1), to be written up as a finding or declared a difference. Logs go to
# .venv-kit/logs/. Needs the package registry (pip download of the two releases).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
steps=${1:-20000}
newest() {
    .venv/bin/python -m pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\(.*\))$/\1/p"
}
vllm=${2:-$(newest vllm)}
transformers=${3:-$(newest transformers)}
if [ -z "$vllm" ] || [ -z "$transformers" ]; then
    echo "kit_releases: cannot read the newest vllm or transformers from the registry; name them" >&2
    exit 2
fi
env=.venv-kit/vllm-${vllm}_transformers-${transformers}
wanted="$vllm $transformers $(sha256sum pyproject.toml | cut -d' ' -f1)"
extra() {
    .venv/bin/python -c 'import sys, tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' "$1"
}
if [ "$(cat "$env/.pagedkv-installed" 2>/dev/null)" != "$wanted" ]; then
    echo "kit_releases: making $env (vllm $vllm, transformers $transformers)" >&2
    python3 -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip
    { extra harness; extra kit; } | sed "s/^transformers==.*/transformers==$transformers/" \
        | xargs "$env/bin/python" -m pip install --quiet
    extra conformance | sed "s/^vllm==.*/vllm==$vllm/" \
        | xargs "$env/bin/python" -m pip install --quiet --no-deps
    "$env/bin/python" -m pip install --quiet --no-deps -e . 2>/dev/null
    echo "$wanted" >"$env/.pagedkv-installed"
fi
pinned() {
    .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"
}
logs=.venv-kit/logs/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$logs"
failed=0
for python in .venv/bin/python "$env/bin/python"; do
    if [ "$python" = .venv/bin/python ]; then
        versions="vllm $(pinned vllm), transformers $(pinned transformers) (pinned)"
    else
        versions="vllm $vllm, transformers $transformers"
    fi
    for target in vllm vllm-mamba transformers; do
        log=$logs/$target-$(echo "$versions" | tr -c 'a-z0-9.\n' _ | cut -c1-60).log
        status=0
        OMP_NUM_THREADS=1 "$python" -m harness.conformance --target "$target" \
            --steps "$steps" --known-findings >"$log" 2>&1 || status=$?
        verdict=$(grep -E "^$target: " "$log" | tail -1)
        echo "$target at $versions: ${verdict:-no verdict (exit $status), see $log}"
        # Each finding seen and how often: the kit's "declared difference ... (FINDING
        # docs/findings/...)" lines, summed over the target's configurations.
        grep -o "seen [0-9]* times (FINDING docs/findings/[^:]*" "$log" \
            | awk '{ n[$NF] += $2 } END { for (f in n) printf "  %s: seen %d times\n", f, n[f] }' \
            | sed 's|docs/findings/||' | sort
        [ "$status" -eq 0 ] || failed=1
    done
done
echo "logs: $logs"
exit "$failed"
