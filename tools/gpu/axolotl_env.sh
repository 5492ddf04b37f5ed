# Install side, on the GPU machine (offline): source tools/gpu/axolotl_env.sh   (from the repo root)
#
# Copies the wheels of every carried closure part (.whl-axolotl/part*/, from
# tools/gpu/axolotl_closure.sh) into a store on the machine's disk, then installs the UNION of the
# store into $FQ_SITE (default /tmp/site) with ONE `pip install --no-index --no-deps --target`
# whenever the store has changed. A warm machine keeps /tmp, so a later call that carries only
# part B installs A + B together. One pip call matters: pip's --target --upgrade replaces each
# top-level folder whole, so installing axolotl-contribs (axolotl/contribs/) or fla-core (fla/)
# in a separate call from axolotl / flash-linear-attention would delete the other half.
# Also installs a causal-conv1d wheel carried in parts (.whl/causal_conv1d-*.whl.partNN) and
# unpacks a carried Triton cache (.gpu-cache/triton-cache.tgz[.partNN]) when present; both optional.
# Do not also source tools/gpu/env.sh in the same call: its own --target install of .whl/*.whl
# would replace /tmp/site/axolotl without the contribs.

_fq_env() {
  local site=${FQ_SITE:-/tmp/site} store=${FQ_WHEEL_STORE:-/tmp/fq-wheels} py=${FQ_PYTHON:-python3}
  mkdir -p "$store" || return 1
  local w base dist
  for w in .whl-axolotl/part*/*.whl; do
    [ -e "$w" ] || continue
    base=$(basename "$w"); dist=${base%%-*}
    # one version per distribution: a wheel carried now replaces an older one of the same name
    for old in "$store/$dist"-*.whl; do
      [ -e "$old" ] && [ "$(basename "$old")" != "$base" ] && rm -f "$old"
    done
    [ -e "$store/$base" ] || cp "$w" "$store/" || return 1
  done
  if ls .whl/causal_conv1d-*.whl.part00 >/dev/null 2>&1; then
    base=$(basename "$(ls .whl/causal_conv1d-*.whl.part00)" .part00)
    [ -e "$store/$base" ] || cat .whl/"$base".part* > "$store/$base" || return 1
  fi
  if ! ls "$store"/*.whl >/dev/null 2>&1; then
    echo "axolotl_env: no wheels: carry .whl-axolotl/partA (tools/gpu/axolotl_closure.sh)" >&2
    return 1
  fi
  local listing
  listing=$(cd "$store" && ls -1 *.whl | sort | sha1sum | cut -c1-16)
  if [ "$(cat "$site/.fq-closure" 2>/dev/null)" != "$listing" ]; then
    local t=$SECONDS
    rm -rf "$site.new"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site.new" "$store"/*.whl || { echo "axolotl_env: pip install failed" >&2; return 1; }
    rm -rf "$site" && mv "$site.new" "$site" && echo "$listing" > "$site/.fq-closure"
    echo "axolotl_env: installed $(ls "$store"/*.whl | wc -l) wheels into $site in $((SECONDS - t)) s"
  else
    echo "axolotl_env: $site already holds these $(ls "$store"/*.whl | wc -l) wheels"
  fi
  export FQ_SITE=$site
  export PYTHONPATH="$PWD:$PWD/tools/gpu:$site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
  mkdir -p "$TRITON_CACHE_DIR"
  if [ ! -e "$TRITON_CACHE_DIR/.fq-unpacked" ]; then
    if ls .gpu-cache/triton-cache.tgz.part* >/dev/null 2>&1; then
      cat .gpu-cache/triton-cache.tgz.part* | tar xzf - -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.fq-unpacked"
    elif [ -f .gpu-cache/triton-cache.tgz ]; then
      tar xzf .gpu-cache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.fq-unpacked"
    fi
  fi
  "$py" - <<'EOF' || return 1
import importlib, sys
out = []
for name in ("torch", "triton", "transformers", "peft", "accelerate", "datasets", "trl", "axolotl", "fla",
             "liger_kernel", "bitsandbytes", "pydantic", "wandb"):
    try:
        m = importlib.import_module(name)
        where = "carried" if "/fq-" in m.__file__ or m.__file__.startswith(__import__("os").environ["FQ_SITE"]) else "image"
        version = getattr(m, "__version__", None)
        if version is None:
            from importlib import metadata
            version = metadata.version(name.replace("_", "-"))
        out.append(f"{name} {version} ({where})")
    except Exception as exc:
        out.append(f"{name} FAILED {type(exc).__name__}: {exc}")
        print("axolotl_env: " + "; ".join(out), file=sys.stderr)
        raise SystemExit(1)
import torch
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
print("axolotl_env: " + "; ".join(out) + f"; {dev}")
EOF
}
_fq_env
