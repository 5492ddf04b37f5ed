#!/usr/bin/env bash
# Build a causal-conv1d wheel for Hopper (sm_90) only, on the GPU machine itself.
#   bash tools/gpu/build_causal_conv1d.sh SDIST OUTDIR
# causal-conv1d's setup.py downloads a prebuilt wheel (impossible offline) or compiles nine
# hard-coded GPU architectures (39 min on 2 cores). This builds from a copy of the sdist whose
# gencode list is cut to sm_90, with the machine's own torch and nvcc (no build isolation).
set -euo pipefail
SDIST="$1"; OUTDIR="$2"
WORK="$(mktemp -d)"
tar xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/causal_conv1d-*)"
python3 - "$SRC/setup.py" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
# keep only the sm_90 gencode pair; every other one becomes `pass` (its `if` block stays valid)
text = re.sub(
    r'\n([ \t]*)cc_flag\.append\("-gencode"\)\n\s*cc_flag\.append\("arch=compute_(?!90,)\d+,code=sm_\d+"\)',
    r"\n\1pass",
    text,
)
assert text.count('arch=compute_90,code=sm_90') == 1, "unexpected setup.py layout"
open(path, "w").write(text)
PY
export CAUSAL_CONV1D_FORCE_BUILD=TRUE
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
start=$(date +%s)
python3 -m pip wheel -q --no-build-isolation --no-deps -w "$OUTDIR" "$SRC"
echo "causal-conv1d sm_90 wheel built in $(( $(date +%s) - start )) s: $(ls "$OUTDIR"/causal_conv1d-*.whl)"
