# Source at the end of a GPU call: wait (bounded) for a background causal-conv1d build, bring its
# wheel back in <16 MiB parts, and bring back Triton's cache for the next call.
for _ in $(seq 1 "${BUILD_WAIT:-0}"); do [ -f /tmp/ccwheel.done ] && break; sleep 1; done
if ls /tmp/ccwheel/causal_conv1d-*.whl >/dev/null 2>&1; then
  whl=$(ls /tmp/ccwheel/causal_conv1d-*.whl); split -b 15M -d "$whl" "$OUT/$(basename "$whl").part"
fi
[ -e "$OUT/triton-cache.txz.part00" ] || tar cf - -C "$TRITON_CACHE_DIR" . | xz -6 -T0 | split -b 15M -d - "$OUT/triton-cache.txz.part"  # <16 MiB each
ls -la "$OUT" "$OUT"/* 2>/dev/null | head -30
