#!/usr/bin/env bash
# The whole test suite: every cell of the upstream-compat matrix tagged `ci` (tools/noxfile.py),
# each in its own uv environment, starting with Axolotl 0.21 and the stack it pins.
#   bash tools/test.sh                     # what CI runs (.ci/run)
#   bash tools/test.sh -- -k packing -x    # pytest arguments for every cell
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup.sh
export AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE  # the suite starts many Python processes: let them share compiled bytecode
export PATH="$ROOT/.venv/bin:$PATH"
nox -f tools/noxfile.py -t ci "$@"
