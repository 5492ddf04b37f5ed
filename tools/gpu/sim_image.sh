#!/usr/bin/env bash
# CPU rehearsal of the H200 `axolotl train` recipe: a venv built like the image
# (tools/gpu/sim_image_requirements.txt: torch 2.11.0 / Triton 3.6.0 / transformers 5.17.0 /
# peft 0.21.0 / accelerate 1.15.0 / numpy 2.5.2 / tokenizers 0.23.2 ...), then ONLY the carried
# closure (.whl-axolotl, tools/gpu/axolotl_closure.sh) installed by tools/gpu/axolotl_env.sh the
# way the machine does it, then the driver with CPU_TEST=1 (toy widths, real 248k vocabulary,
# CUDA-only switches off).
#
#   bash tools/gpu/sim_image.sh                       # build .sim/img once, run fastqwen qlora fft
#   RUNS="axolotl fastqwen" bash tools/gpu/sim_image.sh
#
# `axolotl` (sample_packing) stops at its first forward on CPU (Axolotl's Qwen3.5 packing patch
# calls fla's Triton kernels: "0 active drivers"): that run checks config, imports and patching.
set -euo pipefail
cd "$(dirname "$0")/../.."
UV=${UV:-$(command -v uv || echo /work/main/.venv/bin/uv)}
PY312=${PY312:-$("$UV" python find 3.12 2>/dev/null || echo python3.12)}
SIM=${SIM:-.sim}
if [ ! -x "$SIM/img/bin/python" ]; then
  "$UV" venv -q "$SIM/img" --python "$PY312"
  "$UV" pip install -q --python "$SIM/img/bin/python" --exclude-newer 2026-11-17 \
    -r tools/gpu/sim_image_requirements.txt pip
  # resolved as dependencies here but absent from the image's package list (KINDS.md)
  "$UV" pip uninstall -q --python "$SIM/img/bin/python" pydantic pydantic-core annotated-types \
    typing-inspection tzdata || true
fi
[ -d .whl-axolotl ] || bash tools/gpu/axolotl_closure.sh
export FQ_SITE=$PWD/$SIM/site FQ_WHEEL_STORE=$PWD/$SIM/store FQ_PYTHON=$PWD/$SIM/img/bin/python
export PATH=$PWD/$SIM/img/bin:$PATH
CPU_TEST=1 RUNS=${RUNS:-"fastqwen qlora fft"} LAYERS=${LAYERS:-4} STEPS=${STEPS:-6} BUDGET=${BUDGET:-1024} \
  DEADLINE=${DEADLINE:-3000} RETRY_SAFE=${RETRY_SAFE:-0} ASSETS=$PWD/$SIM/assets WORK=$PWD/$SIM/runs \
  OUT=$PWD/$SIM/out bash tools/gpu/axolotl_train_runs.sh
