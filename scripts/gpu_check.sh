#!/usr/bin/env bash
# The prepared GPU check: run on a machine with one A100/H100 and the project's .venv
# (scripts/setup.sh, with a CUDA build of torch==2.13.0). Installs nothing.
# Writes everything under ${OUT:-out/gpu_check}: environment, CUDA tests, the main command
# with --device cuda --json in float32 and bfloat16 (plus --batch-invariant), and a summary.
# (bench_decode runs on CPU only for now.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
. .venv/bin/activate
# Check 2 on CUDA needs deterministic cuBLAS; both sides use transformers' SDPA call.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export HF_HUB_OFFLINE=1
status=0

{ nvidia-smi; python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/env.txt" 2>&1

python -m pytest -q -m cuda tests/harness/test_cuda.py > "$OUT/pytest_cuda.txt" 2>&1 || status=1

for dtype in float32 bfloat16; do
  python -m harness --device cuda --dtype "$dtype" --poison-freed --json \
    > "$OUT/main_${dtype}.json" 2> "$OUT/main_${dtype}.err" || status=1
  python -m harness --device cuda --dtype "$dtype" --poison-freed --batch-invariant --json \
    > "$OUT/main_${dtype}_batch_invariant.json" 2> "$OUT/main_${dtype}_batch_invariant.err" || status=1
done

# The reference top-2 margins where bf16 check 3 reported ties: calibrate TIE_MARGINS here.
python - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("main_*.json")):
    try:
        result = json.loads(path.read_text())
    except ValueError:
        print(f"{path.name}: no JSON (see {path.with_suffix('.err').name})")
        continue
    rows = result["requests"]
    passed = sum(all(r[c]["passed"] for c in ("gate", "alone", "batch")) for r in rows)
    ties = [r["batch"]["detail"] for r in rows if r["batch"]["tie"]]
    worst = max(r["max_abs_delta_logprob"] for r in rows)
    print(f"{path.name}: {passed}/{len(rows)} pass, ties {len(ties)}, max |dlogprob| {worst:.3g}")
    for detail in ties:
        print(f"  {detail}")
PY
cat "$OUT/summary.txt"
echo "gpu_check: results in $OUT (exit $status)"
exit "$status"
