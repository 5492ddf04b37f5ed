#!/usr/bin/env bash
# The main job: a real `axolotl train` of a tiny Qwen3.5 model with the plugin, on CPU, then the
# plugin's report. Another example config can be given: bash tools/demo.sh examples/tiny-qwen3_next-cpu.yml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
export AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE
export PATH="$ROOT/.venv/bin:$PATH"
CONFIG="${1:-examples/tiny-qwen3_5-cpu.yml}"
axolotl train "$CONFIG" --launcher python
echo
python -m axolotl_fastqwen report "$CONFIG"
