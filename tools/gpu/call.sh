#!/usr/bin/env bash
# One device call: the stages named in $STAGES, in order, each under its own time limit, with every
# result packed into $OUT/results.tgz at the end (the device returns at most 8 files) and Triton's
# cache into $OUT/triton-cache.tgz.partNN (for the next call, if the machine went cold).
#   STAGES="tests bench64" bash tools/gpu/call.sh
# Stage budgets (seconds) are set so that any combination of two fits a 600 s call after install.
set -u
source tools/gpu/env.sh
RES="$OUT/res"; mkdir -p "$RES"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$RES/gpu.txt"
for stage in ${STAGES:-tests}; do
  echo "=== stage $stage ($(date +%T))"
  case "$stage" in
    tests)   # kernel parity at the 27B shapes, model parity, the new loss / LoRA-composition checks
      FASTQWEN_GPU_RESULTS="$RES/gpu_tests.json" timeout "${TESTS_S:-220}" \
        python3 -m pytest -q tests/test_gpu_kernels.py -p no:cacheprovider -rs > "$RES/pytest_gpu.log" 2>&1
      tail -25 "$RES/pytest_gpu.log" ;;
    fittest) # fastqwen_checkpointing: auto on the real CUDA counters (also warms fla's autotuning at 27B head dims)
      FASTQWEN_GPU_RESULTS="$RES/gpu_fit.json" timeout "${FIT_S:-200}" \
        python3 -m pytest -q tests/test_gpu_kernels.py -k checkpoint_fitter -p no:cacheprovider -rs > "$RES/pytest_fit.log" 2>&1
      tail -8 "$RES/pytest_fit.log" ;;
    bench64) # issue 12: the 27B shape at full depth against Axolotl's best configuration
      timeout "${BENCH_S:-330}" python3 -m axolotl_fastqwen bench --model qwen3.5-27b --gc --paths "${BENCH_PATHS:-d,e,f,j}" --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-110}" --max-total-seconds "$(( ${BENCH_S:-330} - 40 ))" --out "$RES/l64" > "$RES/l64.log" 2>&1
      tail -30 "$RES/l64.log" ;;
    moe40)   # issue 13: Qwen3.5-35B-A3B at full depth
      timeout "${MOE_S:-330}" python3 -m axolotl_fastqwen bench --model qwen3.5-35b-a3b --gc --paths "${MOE_PATHS:-i,e,f}" --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-120}" --max-total-seconds "$(( ${MOE_S:-330} - 40 ))" --out "$RES/moe40" > "$RES/moe40.log" 2>&1
      tail -30 "$RES/moe40.log" ;;
    profile64) # issue 12 §2: kernel time by category at full depth, plugin path
      timeout "${PROFILE_S:-150}" python3 -m axolotl_fastqwen profile --model qwen3.5-27b --gc --path fastqwen \
        --steps 2 --warmup 1 --no-trace --out "$RES/prof64" > "$RES/prof64.log" 2>&1
      tail -30 "$RES/prof64.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$RES"
tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M -d - "$OUT/triton-cache.tgz.part"
ls -la "$OUT"
