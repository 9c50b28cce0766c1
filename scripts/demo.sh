#!/usr/bin/env bash
# The main job: set up the environment, then catch a real frozen-adapter run on a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh train,report
exec .venv/bin/deadweight demo "$@"
