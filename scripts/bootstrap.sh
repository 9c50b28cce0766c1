#!/usr/bin/env bash
# Create .venv with everything deadweight needs; safe to run again (it only adds what is missing).
# torch is installed first and pinned to the CPU build that lies on this kind of machine's disk,
# so no other package pulls a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "torch==2.13.0"
fi
"${PIP[@]}" install -e ".[train,dev]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import deadweight.callbacks, deadweight.sidecar.cli, torch, trl, peft" \
  || { echo "bootstrap: the environment is incomplete" >&2; exit 1; }
