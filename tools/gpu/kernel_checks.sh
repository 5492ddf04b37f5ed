#!/usr/bin/env bash
# On the GPU machine: the GPU test suite (kernel parity at the 27B shapes), building causal-conv1d
# for sm_90 in the background when it is not carried yet. Results land in $OUT.
#   bash tools/gpu/kernel_checks.sh
source tools/gpu/env.sh
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if ! python3 -c "import torch, causal_conv1d_cuda" 2>/dev/null; then
  ( MAX_JOBS=12 bash tools/gpu/build_causal_conv1d.sh .gpu-cache/causal_conv1d-*.tar.gz /tmp/ccwheel \
      > "$OUT/build_causal_conv1d.log" 2>&1; touch /tmp/ccwheel.done ) &
fi
FASTQWEN_GPU_RESULTS="$OUT/gpu_tests.json" timeout "${TEST_TIMEOUT:-330}" \
  python3 -m pytest -q tests/test_gpu_kernels.py -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu.log"
if [ ! -f /tmp/site/causal_conv1d_cuda*.so ] && ! python3 -c "import torch, causal_conv1d_cuda" 2>/dev/null; then
  for _ in $(seq 1 "${BUILD_WAIT:-120}"); do [ -f /tmp/ccwheel.done ] && break; sleep 1; done
  if ls /tmp/ccwheel/causal_conv1d-*.whl >/dev/null 2>&1; then
    whl=$(ls /tmp/ccwheel/causal_conv1d-*.whl); name=$(basename "$whl")
    split -b 15M -d "$whl" "$OUT/$name.part"
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl"
    FASTQWEN_GPU_RESULTS="$OUT/gpu_tests_causal_conv1d.json" timeout 150 python3 -m pytest -q \
      tests/test_gpu_kernels.py -k "causal" -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu_causal_conv1d.log"
  fi
fi
tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M -d - "$OUT/triton-cache.tgz.part"  # files come back <16 MiB
ls -la "$OUT"
