#!/usr/bin/env bash
# Create .venv with everything deadweight needs; safe to run again (it only adds what is missing).
# torch is installed first, the CPU build that lies on this kind of machine's disk, and held
# there by a constraint, so no other package swaps it for a multi-gigabyte CUDA build.
# The packages go in with uv (installed into .venv by pip): on this 2-core machine it sets up
# the whole environment in about 40 s, where pip took over two minutes.
# Usage: bash scripts/bootstrap.sh [EXTRAS]
#   (default: train,dev,report,integrations; the demo needs train)
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-train,dev,report,integrations}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
say() { echo "bootstrap: $*"; }
quiet() {
  # This machine's pip configuration lists index folders that may be absent; pip warns
  # about each one on every call. The warning is noise; real errors still fail the script.
  local log status=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || status=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$status"
}
pip_install() { quiet .venv/bin/python -m pip --disable-pip-version-check -q install "$@"; }
# On a machine that sets PYTHONDONTWRITEBYTECODE (this kind does) no process may cache what it
# compiles, so every one would compile torch and transformers again: compile them at install.
# Where Python may write its own caches (.ci/run allows it), each module is compiled once, on
# its first import, and only what runs is compiled (about 40 s of CPU less than all of it).
compile=()
[ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && compile=(--compile-bytecode)
uv_install() { quiet .venv/bin/uv pip install --python .venv/bin/python -q "${compile[@]}" "$@"; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
[ -x .venv/bin/uv ] || pip_install "uv>=0.5,<1"

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch $TORCH_VERSION (CPU build; first run only)"
  tag=$(.venv/bin/python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  wheel=""
  for folder in ${PIP_FIND_LINKS:-} /opt/wheels; do
    for candidate in "$folder"/torch-"$TORCH_VERSION"+cpu-"$tag"-"$tag"-*.whl; do
      [ -f "$candidate" ] && { wheel="$candidate"; break 2; }
    done
  done
  if [ -n "$wheel" ]; then
    uv_install "$wheel"
  else  # pip knows where this machine keeps its wheels when the file is not where we look
    pip_install "torch==$TORCH_VERSION"
  fi
fi
installed_torch=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('torch'))")
held=$(mktemp)
echo "torch==$installed_torch" >"$held"
say "installing deadweight[$EXTRAS] and its dependencies (first run: under a minute)"
uv_install --constraint "$held" -e ".[$EXTRAS]"
rm -f "$held"
.venv/bin/python -c "import deadweight.callbacks, deadweight.sidecar.commands.cli, torch, trl, peft" \
  || { echo "bootstrap: the environment is incomplete" >&2; exit 1; }
say "ready: .venv"
