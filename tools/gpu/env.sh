# Source on the GPU machine (offline): install the carried wheels and point Triton's cache at the
# carried one. Usage: source tools/gpu/env.sh   (from the repository root)
set -e
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if ls .whl/causal_conv1d-*.whl.part* >/dev/null 2>&1; then      # a wheel carried in <16 MiB parts
  cat .whl/causal_conv1d-*.whl.part* > /tmp/$(ls .whl/causal_conv1d-*.whl.part00 | xargs basename | sed 's/.part00$//')
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site /tmp/causal_conv1d-*.whl
fi
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if ls .gpu-cache/triton-cache.txz* >/dev/null 2>&1; then                # xz: a third of the gzip size (carry limit)
  cat .gpu-cache/triton-cache.txz* | tar xJf - -C "$TRITON_CACHE_DIR"
elif ls .gpu-cache/triton-cache.tgz.part* >/dev/null 2>&1; then        # a cache carried in parts
  cat .gpu-cache/triton-cache.tgz.part* | tar xzf - -C "$TRITON_CACHE_DIR"
elif [ -f .gpu-cache/triton-cache.tgz ]; then tar xzf .gpu-cache/triton-cache.tgz -C "$TRITON_CACHE_DIR"; fi
source tools/gpu/flashqla_env.sh                                       # FlashQLA, when carried (optional)
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
set +e
