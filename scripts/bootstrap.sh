#!/usr/bin/env bash
# Create .venv with everything deadweight needs; safe to run again (it only adds what is missing).
# torch is installed first and pinned to the CPU build that lies on this kind of machine's disk,
# so no other package pulls a multi-gigabyte CUDA build.
# Usage: bash scripts/bootstrap.sh [EXTRAS]
#   (default: train,dev,report,integrations; the demo needs train)
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-train,dev,report,integrations}"
PYTHON="${PYTHON:-python3}"
say() { echo "bootstrap: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
pip_install() {
  # This machine's pip configuration lists index folders that may be absent; pip warns
  # about each one on every call. The warning is noise; real errors still fail the script.
  local log status=0
  log=$(mktemp)
  .venv/bin/python -m pip --disable-pip-version-check -q install "$@" >"$log" 2>&1 || status=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$status"
}
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build; first run only, about a minute)"
  pip_install "torch==2.13.0"
fi
say "installing deadweight[$EXTRAS] and its dependencies (first run: about 2 minutes)"
pip_install -e ".[$EXTRAS]"
.venv/bin/python -c "import deadweight.callbacks, deadweight.sidecar.cli, torch, trl, peft" \
  || { echo "bootstrap: the environment is incomplete" >&2; exit 1; }
say "ready: .venv"
