#!/usr/bin/env bash
# The device check, one command: on a machine with a CUDA GPU (under 8 minutes) it prints the
# host syncs per step deadweight's hooks force on the training thread, their share of a real
# Qwen3-0.6B-shaped bf16 training step (LoRA r16 and full fine-tune) and the update pass
# against the device's bandwidth bound. Without a GPU it says so in one line and exits 3.
# Usage: bash bench/device.sh [--smoke] [--steps N]   (--smoke: tiny shape on the CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" -m bench.device_check "$@"
