#!/usr/bin/env bash
# Here (pip reaches PyPI): FlashQLA 0.1.3 and what the GPU image lacks of its closure, in two parts
# that each fit one device call beside .whl (64 MiB a call): partA tilelang (49.6 MB), partB
# z3-solver, apache-tvm-ffi, torch-c-dlpack-ext, flash-qla (33 MB). cloudpickle, ml-dtypes, psutil,
# tqdm are on the image. On the machine, tools/gpu/flashqla_env.sh (sourced by env.sh) installs the
# set once both parts have been carried (a warm machine keeps what the first call left).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
rm -rf .whl-flashqla && mkdir -p .whl-flashqla/partA .whl-flashqla/partB
dl .whl-flashqla/partA tilelang==0.1.15
dl .whl-flashqla/partB flash-qla==0.1.3 'z3-solver==4.15.4.0' 'apache-tvm-ffi==0.1.12' torch-c-dlpack-ext==0.1.5
(cd .whl-flashqla && ls part*/*.whl | xargs -n1 basename | sort > MANIFEST && cp MANIFEST partA/ && cp MANIFEST partB/)
du -sh .whl-flashqla/part*; cat .whl-flashqla/MANIFEST
