#!/usr/bin/env bash
# transformers' own modeling tests for the Qwen hybrid families (qwen3_5, qwen3_5_moe, qwen3_next),
# run twice: stock (PyTorch kernel fallbacks forced) and with every constructed model patched by
# axolotl_fastqwen.patch_model. Summary: tools/hf_modeling_tests/out/summary.{md,json}.
#
#   TRANSFORMERS_TESTS=/path/to/transformers bash tools/hf_modeling_tests/run.sh   # a checkout (tag v<installed>)
#   bash tools/hf_modeling_tests/run.sh --clone          # shallow sparse clone of tag v<installed> from GitHub
#   bash tools/hf_modeling_tests/run.sh -- -k generate   # extra pytest arguments, for both runs
#
# Env: PYTHON (default: the repo's .venv, else python3), HF_TESTS_THREADS (torch threads, default 1),
# HF_TESTS_TIMEOUT (per test, default 600 s), HF_TESTS_MODES ("stock patched"), HF_TESTS_OUT,
# HF_TESTS_SLOW=1 (also transformers' @slow tests: export, compile, eager-vs-sdpa generate; the
# integration tests among them need Hub checkpoints and fail offline on both runs).
# The top-level tests/*.py always come from the installed version's PyPI sdist; the rest (tests/models,
# tests/generation, causal_lm_tester.py, utils/test_module, conftest.py) is not in the sdist.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
CACHE="$HERE/.cache"
OUT="${HF_TESTS_OUT:-$HERE/out}"
CLONE=()
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --clone) CLONE=(--clone); shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

export PYTHONPATH="$ROOT:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 USE_HUB_KERNELS=0 \
  AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
THREADS="${HF_TESTS_THREADS:-1}"
if [ "${HF_TESTS_SLOW:-0}" = 1 ]; then export RUN_SLOW=1; else unset RUN_SLOW; fi
export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"

# transformers' test-suite dependencies these modules import (all small, pure Python)
TEST_DEPS=(parameterized pytest-timeout pytest-xdist timeout-decorator)
if ! "$PYTHON" -c "import parameterized, pytest_timeout, xdist, timeout_decorator" 2>/dev/null; then
  if command -v uv >/dev/null 2>&1; then uv pip install -p "$PYTHON" "${TEST_DEPS[@]}"
  elif [ -x "$(dirname "$PYTHON")/uv" ]; then "$(dirname "$PYTHON")/uv" pip install -p "$PYTHON" "${TEST_DEPS[@]}"
  else "$PYTHON" -m pip install "${TEST_DEPS[@]}"; fi
fi

TREE="$("$PYTHON" "$HERE/assemble.py" "$CACHE" "${CLONE[@]}")"
mkdir -p "$OUT"
cp "$TREE/provenance.json" "$OUT/provenance.json"
MODULES=(tests/models/qwen3_5/test_modeling_qwen3_5.py
         tests/models/qwen3_5_moe/test_modeling_qwen3_5_moe.py
         tests/models/qwen3_next/test_modeling_qwen3_next.py)

for MODE in ${HF_TESTS_MODES:-stock patched}; do
  echo "== $MODE run ($TREE)" >&2
  ( cd "$TREE" && "$PYTHON" -m pytest -p no:cacheprovider -p fastqwen_hf_plugin \
      --fastqwen-mode="$MODE" --fastqwen-results="$OUT/$MODE.json" \
      -q -rN -o log_cli=false -W ignore --timeout="${HF_TESTS_TIMEOUT:-600}" \
      "${MODULES[@]}" "${EXTRA[@]}" ) > "$OUT/$MODE.log" 2>&1 || true  # failures are the data
  tail -n 1 "$OUT/$MODE.log" >&2
done
"$PYTHON" "$HERE/summarize.py" "$OUT"
