#!/usr/bin/env bash
# The whole test suite: the main environment (Axolotl 0.21 and its pinned stack), then the
# upstream-compat matrix cells that CI can afford (tools/noxfile.py lists all of them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
export AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PATH="$ROOT/.venv/bin:$PATH"
python -m pytest -q "$@"
if [ "${FASTQWEN_MATRIX:-ci}" != "none" ]; then
  nox -f tools/noxfile.py -t ci
fi
