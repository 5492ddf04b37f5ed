#!/usr/bin/env bash
# One device call: the stages named in $STAGES, in order, each under its own time limit, with every
# result packed into $OUT/results.tgz after each stage (the device returns at most 8 files; a call
# stopped at its limit still returns the finished stages) and Triton's cache into
# $OUT/triton-cache.txz.partNN at the end (for the next call, if the machine went cold).
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
    fittest) # fastqwen_checkpointing: auto on the real CUDA counters (also warms fla's autotuning at 27B head dims),
             # and the experts self-check at the MoE shapes (FIT_K selects other GPU tests)
      FASTQWEN_GPU_RESULTS="$RES/gpu_fit.json" timeout "${FIT_S:-200}" \
        python3 -m pytest -q tests/test_gpu_kernels.py -k "${FIT_K:-checkpoint_fitter or experts_selfcheck}" -p no:cacheprovider -rs > "$RES/pytest_fit.log" 2>&1
      tail -8 "$RES/pytest_fit.log" ;;
    bench64) # issue 12: the 27B shape at full depth against Axolotl's best configuration
      timeout "${BENCH_S:-330}" python3 -m fastqwen_bench bench --model qwen3.5-27b --gc --paths "${BENCH_PATHS:-d,e,f,j}" --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-110}" --max-total-seconds "$(( ${BENCH_S:-330} - 40 ))" --out "$RES/l64" > "$RES/l64.log" 2>&1
      tail -30 "$RES/l64.log" ;;
    bench64:*) # a variant of bench64: `bench64:<tag>` runs ARGS_<tag> (extra bench arguments, e.g.
               # "--paths l --allocator default") into $RES/l64_<tag>, within BENCH_S_<tag> (else BENCH_S) seconds
      tag="${stage#bench64:}"; eval "extra=\${ARGS_${tag}:-}"; eval "limit=\${BENCH_S_${tag}:-${BENCH_S:-330}}"
      timeout "$limit" python3 -m fastqwen_bench bench --model qwen3.5-27b --gc --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-110}" --max-total-seconds "$(( limit - 40 ))" $extra \
        --out "$RES/l64_$tag" > "$RES/l64_$tag.log" 2>&1
      tail -12 "$RES/l64_$tag.log" ;;
    moe40)   # issue 13: Qwen3.5-35B-A3B at full depth
      timeout "${MOE_S:-330}" python3 -m fastqwen_bench bench --model qwen3.5-35b-a3b --gc --paths "${MOE_PATHS:-i,e,f}" --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-120}" --max-total-seconds "$(( ${MOE_S:-330} - 40 ))" ${MOE_ARGS:-} --out "$RES/moe40" > "$RES/moe40.log" 2>&1
      tail -30 "$RES/moe40.log" ;;
    moe40:*) # a variant of moe40: `moe40:<tag>` runs ARGS_<tag> (bench arguments incl. --paths) into $RES/moe40_<tag>
      tag="${stage#moe40:}"; eval "extra=\${ARGS_${tag}:-}"
      timeout "${MOE_S:-330}" python3 -m fastqwen_bench bench --model qwen3.5-35b-a3b --gc --steps 3 --warmup 1 \
        --max-path-seconds "${PATH_S:-120}" --max-total-seconds "$(( ${MOE_S:-330} - 40 ))" $extra \
        --out "$RES/moe40_$tag" > "$RES/moe40_$tag.log" 2>&1
      tail -14 "$RES/moe40_$tag.log" ;;
    moe80)   # issue 13: Qwen3-Next-80B-A3B cut to the depth that fits one H200 (MOE80_LAYERS, default 24 of 48)
      timeout "${MOE80_S:-300}" python3 -m fastqwen_bench bench --model qwen3-next-80b-a3b --layers "${MOE80_LAYERS:-24}" --gc \
        --paths "${MOE80_PATHS:-m,f}" --steps 3 --warmup 1 --max-path-seconds "${PATH_S:-120}" \
        --max-total-seconds "$(( ${MOE80_S:-300} - 40 ))" ${MOE80_ARGS:-} --out "$RES/moe80" > "$RES/moe80.log" 2>&1
      tail -30 "$RES/moe80.log" ;;
    profile64) # issue 12 §2 / issue 13 §1: kernel time by category at full depth, one path (PROFILE_PATH, default
               # the plugin's) of one shape (PROFILE_MODEL, default the 27B; MoE shapes add router / experts),
               # PROFILE_ARGS extra arguments (e.g. --lora-experts)
      timeout "${PROFILE_S:-150}" python3 -m fastqwen_bench profile --model "${PROFILE_MODEL:-qwen3.5-27b}" --gc --path "${PROFILE_PATH:-fastqwen}" \
        --steps 2 --warmup 1 --top 30 --no-trace ${PROFILE_ARGS:-} --out "$RES/prof64" > "$RES/prof64.log" 2>&1
      tail -30 "$RES/prof64.log" ;;
    fp8tests) # issue 35: the FP8 quantization kernel, the FP8 GEMMs at the 27B shapes, a LoRA slice on FP8
      FASTQWEN_GPU_RESULTS="$RES/gpu_fp8.json" timeout "${FP8_S:-200}" \
        python3 -m pytest -q tests/test_gpu_kernels.py -k "${FP8_K:-fp8}" -p no:cacheprovider -rs > "$RES/pytest_fp8.log" 2>&1
      tail -8 "$RES/pytest_fp8.log" ;;
    fp8gemm)  # issue 35: each frozen projection's GEMM pair, bf16 vs FP8 (both input-gradient layouts), 8k tokens
      timeout "${FP8GEMM_S:-120}" python3 tools/gpu/fp8_gemm_timing.py --model "${FP8GEMM_MODEL:-qwen3.5-27b}" \
        --tokens 8192 --out "$RES/fp8_gemm.json" > "$RES/fp8_gemm.log" 2>&1
      tail -9 "$RES/fp8_gemm.log" | cut -c1-400 ;;
    fp8loss)  # issue 35: the same LoRA run in bf16 and in FP8 (LOSS_LAYERS, LOSS_STEPS, LOSS_ARGS)
      timeout "${FP8LOSS_S:-400}" python3 tools/gpu/fp8_loss_pair.py --layers "${LOSS_LAYERS:-16}" \
        --steps "${LOSS_STEPS:-300}" ${LOSS_ARGS:-} --out "$RES/fp8_loss" > "$RES/fp8_loss.log" 2>&1
      tail -14 "$RES/fp8_loss.log" ;;
    attention) # issue 37 item 2: causal attention fwd+bwd at the 27B's head shape, varlen vs SDPA's backends per sequence
      timeout "${ATTN_S:-150}" python3 tools/gpu/attention_timing.py ${ATTN_ARGS:-} --out "$RES/attention.json" \
        > "$RES/attention.log" 2>&1
      tail -6 "$RES/attention.log" | cut -c1-600 ;;
    offloadtest) # issue 37: the checkpoint offload on the 27B slice at 32k (OFFLOAD_K selects other GPU tests)
      FASTQWEN_GPU_RESULTS="$RES/gpu_offload.json" timeout "${OFFLOAD_S:-150}" \
        python3 -m pytest -q tests/test_gpu_kernels.py -k "${OFFLOAD_K:-checkpoint_offload}" -p no:cacheprovider -rs > "$RES/pytest_offload.log" 2>&1
      tail -8 "$RES/pytest_offload.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
  # packed after every stage, so that a call killed at its limit still returns the finished stages
  tar czf "$OUT/results.tgz" -C "$OUT" res
done
rm -rf "$RES"
# Triton's cache comes back xz-compressed (a third of gzip's size: the returned files are capped in
# total as well as each under 16 MiB); env.sh unpacks `.gpu-cache/triton-cache.txz*` first.
tar cf - -C "$TRITON_CACHE_DIR" . | xz -6 -T0 | split -b 15M -d - "$OUT/triton-cache.txz.part"
ls -la "$OUT"
