# Source after env.sh: start the sm_90 causal-conv1d build in the background unless it is installed.
if ! python3 -c "import torch, causal_conv1d_cuda" 2>/dev/null; then
  ( MAX_JOBS="${MAX_JOBS:-8}" bash tools/gpu/build_causal_conv1d.sh .gpu-cache/causal_conv1d-*.tar.gz /tmp/ccwheel \
      > /tmp/build_causal_conv1d.log 2>&1; cp /tmp/build_causal_conv1d.log "$OUT/"; touch /tmp/ccwheel.done ) &
fi
