#!/usr/bin/env bash
# The main job: a real `axolotl train` of a tiny Qwen3.5 model with the plugin, on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
export AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PATH="$ROOT/.venv/bin:$PATH"
CONFIG="${1:-examples/tiny-qwen3_5-cpu.yml}"
rm -rf outputs/tiny-demo-prepared
axolotl train "$CONFIG" --launcher python
python -m axolotl_fastqwen report "$CONFIG"
