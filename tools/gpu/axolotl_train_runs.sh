#!/usr/bin/env bash
# Real `axolotl train` runs on the GPU machine, one after another, then one summary in $OUT.
#
#   RUNS="axolotl fastqwen" bash tools/gpu/axolotl_train_runs.sh     # call 1 (carry .whl-axolotl)
#   RUNS="qlora fft"        bash tools/gpu/axolotl_train_runs.sh     # call 2
#
# Steps: source tools/gpu/axolotl_env.sh (installs the carried closure into /tmp/site); write the
# 27B-shaped checkpoint + tokenizer + chat data (tools/gpu/make_27b_assets.py; reused when present);
# for each run, derive its YAML from examples/ (tools/gpu/make_train_config.py), start
# `python3 -m axolotl.cli.main train CONFIG --launcher python` (the `axolotl train` entry point; the
# python launcher keeps it one process, so a timeout frees the GPU) under `timeout`, keep its
# log, the probe's record and our plugin's report; a run that dies before its first step is
# retried once as RUN-safe (RETRY_SAFE=1). Finally tools/gpu/parse_train_logs.py writes the
# summary; $OUT gets 4 files: train_<tag>.json / .md / .png and logs_<tag>.tgz (configs, logs,
# probe records, our plugin's reports, the asset manifest). Runs left in $WORK by an earlier call
# on a warm machine are summarised too (one overlay of every run).
#
# Knobs (env): RUNS, LAYERS (8), STEPS (60; ASSET_STEPS, default STEPS, sizes the data: keep it the
# same in every call of a series, or the assets are rewritten), BUDGET (8192), GC (0), SEED (42), ASSETS (/tmp/fq27b),
# WORK (/tmp/fq-runs), DEADLINE (560 s of this script's wall time: no run starts with < MIN_RUN
# (150 s) left; each run's, and a retry's, timeout is its fair share of what is left, at most
# RUN_TIMEOUT (400 s)), RETRY_SAFE (1; once a -safe retry succeeds, later axolotl/fastqwen runs
# use -safe too, so both keep the same switches),
# SET (extra make_train_config --set items, space separated, applied to every run), TAG,
# VISION_ROWS (image+text rows for the vision runs, issue 34; 0: none; part of the assets' identity),
# STEPS_<run> (max_steps of one run, dashes as underscores: STEPS_vision_plugin=10),
# CPU_TEST=1 (tiny widths on CPU, CUDA-only switches off: the CPU rehearsal of this script).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
RUNS=${RUNS:-"axolotl fastqwen"}; RUNS=${RUNS//,/ }
LAYERS=${LAYERS:-8}; STEPS=${STEPS:-60}; BUDGET=${BUDGET:-8192}; GC=${GC:-0}; SEED=${SEED:-42}
ASSETS=${ASSETS:-/tmp/fq27b}; WORK=${WORK:-/tmp/fq-runs}; DEADLINE=${DEADLINE:-560}; MIN_RUN=${MIN_RUN:-150}
RUN_TIMEOUT=${RUN_TIMEOUT:-400}; RETRY_SAFE=${RETRY_SAFE:-1}; CPU_TEST=${CPU_TEST:-0}; SET=${SET:-}
TAG=${TAG:-$(echo "$RUNS" | tr ' ' '_')}
DEST=${OUT:-$PWD/outputs/gpu-train}
mkdir -p "$DEST" "$WORK"

log() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*"; }

source tools/gpu/axolotl_env.sh || { log "closure install failed"; exit 1; }
PY=${FQ_PYTHON:-python3}
log "closure ready"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

asset_args=(--out "$ASSETS" --layers "$LAYERS" --steps "${ASSET_STEPS:-$STEPS}" --budget "$BUDGET"
            --vision-rows "${VISION_ROWS:-0}")
cfg_extra=()
if [ "$CPU_TEST" = 1 ]; then
  asset_args+=(--tiny --device cpu --median "${MEDIAN:-300}")
  cfg_extra+=(--cpu)
fi
$PY tools/gpu/make_27b_assets.py "${asset_args[@]}" > "$WORK/assets.json" 2> "$WORK/assets.log" \
  || { log "asset writing failed"; tail -20 "$WORK/assets.log"; exit 1; }
MODEL=$($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('checkpoint'))" "$WORK/assets.json")
DATA=$($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('data'))" "$WORK/assets.json")
VDATA=$($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('vision_data'))" "$WORK/assets.json")
cp "$ASSETS/MANIFEST.json" "$WORK/assets_manifest.json" 2>/dev/null || true
log "assets: $MODEL, $DATA"
df -h /tmp | tail -1

set_args=()
for kv in $SET; do set_args+=(--set "$kv"); done
[ "$GC" = 1 ] && cfg_extra+=(--gc)

one_run() {  # one_run NAME TIMEOUT -> exit code; leaves $WORK/NAME/{config.yml,train.log,run.json,...}
  local name=$1 limit=$2 dir="$WORK/$1" data=$DATA steps
  [[ "$name" == vision* ]] && data=$VDATA
  eval "steps=\${STEPS_${name//-/_}:-$STEPS}"  # STEPS_<run> (dashes as _) overrides STEPS for one run
  rm -rf "$dir"; mkdir -p "$dir"
  $PY tools/gpu/make_train_config.py --run "$name" --model "$MODEL" --data "$data" --out-dir "$dir/out" \
    --prepared "$WORK/prepared-$name" --budget "$BUDGET" --max-steps "$steps" --seed "$SEED" \
    "${cfg_extra[@]}" "${set_args[@]}" -o "$dir/config.yml" >/dev/null || return 90
  log "run $name (timeout ${limit}s)"
  local t0=$SECONDS rc
  FQ_T0=$(date +%s.%N) FQ_PROBE_OUT="$dir/train_probe.json" \
    timeout -k 20 "$limit" $PY -m axolotl.cli.main train "$dir/config.yml" --launcher python > "$dir/train.log" 2>&1
  rc=$?
  cp "$dir/out/fastqwen_report.json" "$dir/" 2>/dev/null || true
  find "$dir/out" -name "*.safetensors" -size +100M -delete 2>/dev/null  # FFT's 11 GB final save
  printf '{"run": "%s", "exit_code": %d, "wall_s": %d, "timeout_s": %d, "config": "%s"}\n' \
    "$name" "$rc" $((SECONDS - t0)) "$limit" "$dir/config.yml" > "$dir/run.json"
  log "run $name: exit $rc after $((SECONDS - t0)) s; $(grep -o "'train_runtime': '[^']*'" "$dir/train.log" | tail -1)"
  [ $rc -ne 0 ] && tail -5 "$dir/train.log" | cut -c1-400
  return $rc
}

first_step_seen() { grep -q '"first_step_end"' "$WORK/$1/train_probe.json" 2>/dev/null || grep -q "{'loss'" "$WORK/$1/train.log" 2>/dev/null; }

paired() { [[ "$1" == axolotl || "$1" == fastqwen || "$1" == example || "$1" == example-plugin ]]; }
set -- $RUNS
force_safe=0  # once one run of a pair needed its -safe variant, the other runs it too (same switches)
for run in $RUNS; do
  [ $force_safe = 1 ] && paired "$run" && run="$run-safe"
  left=$((DEADLINE - (SECONDS - START)))
  if [ $left -lt "$MIN_RUN" ]; then log "skip $run: ${left}s left"; shift; continue; fi
  share=$(( (left - 25) / $# ))  # the runs still to come each keep a fair share of the time
  [ $share -lt "$MIN_RUN" ] && share=$MIN_RUN
  limit=$(( share < RUN_TIMEOUT ? share : RUN_TIMEOUT )); shift
  one_run "$run" "$limit"; rc=$?
  [ $rc -eq 0 ] && rm -rf "$WORK/$run-safe"  # a stale retry from an earlier call
  if [ $rc -ne 0 ] && [ "$RETRY_SAFE" = 1 ] && paired "$run" && ! first_step_seen "$run"; then
    left=$((DEADLINE - (SECONDS - START)))
    if [ $left -ge "$MIN_RUN" ]; then
      log "retry $run without fused_attn_kernel / liger_rms_norm_gated"
      share=$(( (left - 25) / ($# + 1) )); [ $share -lt "$MIN_RUN" ] && share=$MIN_RUN
      limit=$(( share < RUN_TIMEOUT ? share : RUN_TIMEOUT ))
      one_run "$run-safe" "$limit" && force_safe=1
    fi
  fi
done

$PY tools/gpu/parse_train_logs.py "$WORK" --json "$DEST/train_$TAG.json" --md "$DEST/train_$TAG.md" \
  --png "$DEST/train_$TAG.png" --extra "$WORK/assets.json" > /dev/null || log "parser failed"
tar czf "$DEST/logs_$TAG.tgz" -C "$WORK" --exclude='out' --exclude='prepared-*' . 2>/dev/null
if [ "$(stat -c %s "$DEST/logs_$TAG.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then  # files back: <16 MiB
  tar czf "$DEST/logs_$TAG.tgz" -C "$WORK" --exclude='out' --exclude='prepared-*' --exclude='train.log' .
fi
cat "$DEST/train_$TAG.md" 2>/dev/null | head -40
log "done; files in $DEST: $(ls "$DEST" | tr '\n' ' ')"
