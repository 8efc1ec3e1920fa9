#!/usr/bin/env bash
# The main job: set up .venv, then run the paged-vs-dense equivalence harness on the
# bundled SmolLM2-135M-Instruct model. Arguments go to `python -m harness` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m harness "$@"
