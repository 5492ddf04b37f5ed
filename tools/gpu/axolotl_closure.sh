#!/usr/bin/env bash
# Download side (run here, where pip reaches PyPI): the wheels that `axolotl train` (Axolotl 0.21.0)
# needs on the H200 image beyond what the image already has, packed into .whl-axolotl/partA,
# partB, ... of at most PART_MIB MiB each (each part is carried by one device call; the machine's
# install side, tools/gpu/axolotl_env.sh, installs the union of all parts it has seen).
#
#   bash tools/gpu/axolotl_closure.sh            # -> .whl-axolotl/partA (+ partB ...), MANIFEST.tsv
#   SLIM_BNB=0 bash tools/gpu/axolotl_closure.sh # bitsandbytes' wheel as published (43 MB: 2 parts)
#   EXCLUDE="transformers" bash ...               # leave out named wheels (12 MiB for transformers)
#
# How the list was found (tools/gpu/README.md, "Axolotl's dependency closure"): a venv built like
# the image (tools/gpu/sim_image_requirements.txt), only these wheels installed with
# `pip install --no-index --no-deps --target`, and `axolotl train` runs of the tiny configs plus
# imports of every module the GPU configs reach, adding a wheel at each ModuleNotFoundError.
# Everything else Axolotl's metadata names (gradio, trackio, optimum, lm_eval, s3fs/gcsfs/adlfs/
# ocifs, mistral-common, torchao, kernels, xformers, schedulefree, openenv, ...) is imported only
# inside functions / try blocks for features these runs don't use.
#
# SLIM_BNB=1 (default): bitsandbytes 0.50.2 repacked with only the libraries this image can load
# (libbitsandbytes_cpu.so, _cuda130.so, _cuda132.so; torch 2.11 here is cu130, and the cuda130
# library carries sm_90 SASS), RECORD rewritten: the same package minus the CUDA 11.8-12.8, ROCm
# and XPU builds (38 MB of the 43 MB wheel). BNB_CUDA_VERSION must then stay unset or 130/132.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT_DIR:-.whl-axolotl}
CACHE=${CACHE_DIR:-.whl-axolotl-cache}
PART_MIB=${PART_MIB:-55}
SLIM_BNB=${SLIM_BNB:-1}
PY=${PYTHON:-python3}

# name==version, grouped; versions are Axolotl 0.21.0's pins where it pins, else what a fresh
# `pip install axolotl==0.21.0` resolved on 2026-12-02.
WHEELS=(
  # Axolotl and the Hugging Face stack it pins (image: transformers 5.17.0, peft 0.21.0)
  axolotl==0.21.0 transformers==5.20.1 peft==0.21.2 datasets==5.0.1 trl==1.14.1
  # datasets / evaluate
  dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.1
  # Axolotl's config schema (pydantic is not on the image)
  pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.15.0
  # Axolotl CLI / telemetry (imported at module level even with AXOLOTL_DO_NOT_TRACK=1)
  python-dotenv==1.0.1 fire==0.7.1 termcolor==3.3.0 addict==2.4.0 fastcore==2.2.41
  posthog==6.7.11 backoff==2.2.1 distro==1.9.0
  # axolotl.utils.callbacks imports wandb at module level
  wandb==0.31.0 platformdirs==4.14.9 opentelemetry-api==1.45.2
  # axolotl.loaders.adapter / axolotl.kernels import bitsandbytes at module level; QLoRA, 8-bit AdamW
  bitsandbytes==0.50.2
  # kernels: Liger (LigerPlugin, our fused CE), flash-linear-attention (Axolotl's Qwen3.5
  # packing patch and our plugin). fla 0.6.0, not Axolotl's 0.5.2 pin: 0.6.0 is what tools/gpu
  # validated on this image's Triton 3.6 (FLA_VERSION=0.5.2 to follow the pin).
  liger-kernel==0.8.4 "fla-core==${FLA_VERSION:-0.6.0}" "flash-linear-attention==${FLA_VERSION:-0.6.0}"
)
SDIST_ONLY=(axolotl-contribs-lgpl==0.0.7 axolotl-contribs-mit==0.0.6)  # no wheels on PyPI: built here

PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$CACHE/dl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$CACHE/dl" "${WHEELS[@]}" 2>&1 | { grep -v "is ignored: it is neither" || true; }
for spec in "${SDIST_ONLY[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  ls "$CACHE/dl/${name//-/_}-${ver}-"*.whl >/dev/null 2>&1 || \
    "$PY" -m pip wheel -q --no-deps -w "$CACHE/dl" "$spec" 2>&1 | { grep -v "is ignored: it is neither" || true; }
done

stage="$CACHE/stage"; rm -rf "$stage"; mkdir -p "$stage"
EXCLUDE=" ${EXCLUDE:-} "  # e.g. EXCLUDE=transformers: keep the image's 5.17 (passed the CPU rehearsal too)
for spec in "${WHEELS[@]}" "${SDIST_ONLY[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  [[ "$EXCLUDE" == *" $name "* ]] && { echo "excluded: $spec"; continue; }
  norm=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
  f=$(ls "$CACHE/dl/" | grep -i "^${norm}-${ver}-.*\.whl$" | head -1 || true)
  [ -n "$f" ] || { echo "missing wheel for $spec" >&2; exit 1; }
  cp "$CACHE/dl/$f" "$stage/"
done

if [ "$SLIM_BNB" = 1 ]; then
  bnb=$(ls "$stage"/bitsandbytes-*.whl)
  "$PY" tools/gpu/slim_bnb.py "$bnb"
fi

# parts: largest first, first fit into PART_MIB parts; wheels sharing a top-level folder (axolotl +
# contribs, fla-core + flash-linear-attention) go together (axolotl_env.sh installs the union
# anyway, so this only keeps each part self-consistent).
rm -rf "$OUT"; mkdir -p "$OUT"
"$PY" - "$stage" "$OUT" "$PART_MIB" <<'EOF'
import hashlib, os, shutil, string, sys, zipfile
stage, out, part_mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
limit = part_mib * 2**20
groups = {}
for f in sorted(os.listdir(stage)):
    with zipfile.ZipFile(os.path.join(stage, f)) as z:
        tops = {n.split("/")[0] for n in z.namelist() if ".dist-info" not in n.split("/")[0] and ".data" not in n.split("/")[0]}
    key = "axolotl" if "axolotl" in tops else "fla" if "fla" in tops else f
    groups.setdefault(key, []).append(f)
items = sorted(((sum(os.path.getsize(os.path.join(stage, f)) for f in fs), fs) for fs in groups.values()), reverse=True)
parts = []
for size, fs in items:
    for p in parts:
        if p[0] + size <= limit:
            p[0] += size; p[1].extend(fs); break
    else:
        parts.append([size, list(fs)])
rows = []
for i, (size, fs) in enumerate(parts):
    name = "part" + string.ascii_uppercase[i]
    os.makedirs(os.path.join(out, name))
    for f in sorted(fs):
        path = os.path.join(stage, f)
        shutil.copy2(path, os.path.join(out, name, f))
        rows.append((name, f, os.path.getsize(path), hashlib.sha256(open(path, "rb").read()).hexdigest()))
with open(os.path.join(out, "MANIFEST.tsv"), "w") as fh:
    fh.write("part\twheel\tbytes\tsha256\n")
    for r in rows:
        fh.write("\t".join(map(str, r)) + "\n")
for i, (size, fs) in enumerate(parts):
    print(f"part{string.ascii_uppercase[i]}: {len(fs)} wheels, {size / 2**20:.1f} MiB")
print(f"total: {sum(r[2] for r in rows) / 2**20:.1f} MiB in {len(rows)} wheels")
EOF
echo "carry: $(ls -d "$OUT"/part* | tr '\n' ' ')"
