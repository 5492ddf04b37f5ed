# Sourced by tools/gpu/env.sh on the GPU machine. FlashQLA's wheels travel in two parts
# (.whl-flashqla/partA, partB: tools/gpu/flashqla_wheels.sh); each call copies what it carries into
# a store on the machine's disk, and the call that completes the MANIFEST installs the set into
# /tmp/qla-site. It is put on PYTHONPATH only with FQ_FLASHQLA=1: once importable, fla 0.6 routes
# every chunk_gated_delta_rule call it can (Axolotl's path too) to FlashQLA.
_fq_qla() {
  local store=/tmp/fq-qla-store site=/tmp/qla-site w manifest
  mkdir -p "$store"
  for w in .whl-flashqla/part*/*.whl .whl-flashqla/part*/MANIFEST; do [ -e "$w" ] && [ ! -e "$store/$(basename "$w")" ] && cp "$w" "$store/"; done; true
  manifest="$store/MANIFEST"
  [ -f "$manifest" ] || return 0
  if [ ! -f "$site/.complete" ]; then
    local missing; missing=$(cd "$store" && while read -r f; do [ -e "$f" ] || echo "$f"; done < MANIFEST; true)
    if [ -n "$missing" ]; then echo "flashqla_env: waiting for $(echo $missing)"; return 0; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$store"/*.whl \
      && touch "$site/.complete" && echo "flashqla_env: installed $(wc -l < "$manifest") wheels into $site"
  fi
  if [ "${FQ_FLASHQLA:-0}" = 1 ] && [ -f "$site/.complete" ]; then
    export PYTHONPATH="$PYTHONPATH:$site"
    export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
    export TILELANG_CACHE_DIR="${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}"
    python3 -c "import flash_qla, tilelang; print('flashqla_env: flash_qla', flash_qla.__version__, 'tilelang', tilelang.__version__)" \
      || echo "flashqla_env: flash_qla does not import"
  fi
}
_fq_qla
