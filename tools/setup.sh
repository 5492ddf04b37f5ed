#!/usr/bin/env bash
# Create (or reuse) the project environment .venv and the tiny local assets in .assets/.
# Needs only python3 >= 3.8 with venv and access to PyPI; finds or installs Python 3.12 itself.
# Re-running is cheap: it reinstalls only when pyproject.toml or the pins changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PINS="tools/requirements/axolotl-0.21.txt"
say() { printf '[setup] %s\n' "$*" >&2; }

# 1. uv: on PATH, or a private copy in .cache/uvenv (pinned).
if command -v uv >/dev/null 2>&1; then
  UV="$(command -v uv)"
else
  UV="$ROOT/.cache/uvenv/bin/uv"
  if [ ! -x "$UV" ]; then
    say "installing uv into .cache/uvenv"
    python3 -m venv "$ROOT/.cache/uvenv"
    "$ROOT/.cache/uvenv/bin/python" -m pip install -q --disable-pip-version-check "uv==0.13.8"
  fi
fi
export UV

# 2. Python >= 3.12 (Axolotl 0.20+ needs it): $FASTQWEN_PYTHON, PATH, pyenv, else uv-managed.
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
find_python() {
  local c
  for c in "${FASTQWEN_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && py_ok "$(command -v "$c")" && { command -v "$c"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.12*/bin/python3 "$(pyenv root)"/versions/3.13*/bin/python3; do
      [ -x "$c" ] && py_ok "$c" && { echo "$c"; return; }
    done
  fi
  say "no Python >= 3.12 found: installing one with uv"
  "$UV" python install 3.12 >&2
  "$UV" python find 3.12
}

# 3. The environment: the package (editable) with its dev extra, pinned to Axolotl 0.21's stack.
STAMP=".venv/.fastqwen-setup"
WANT="$(cat pyproject.toml "$PINS" | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  PY="$(find_python)"
  say "creating .venv with $PY ($("$PY" --version))"
  [ -x .venv/bin/python ] || "$UV" venv -q -p "$PY" .venv
  start=$(date +%s)
  "$UV" pip install -q -p .venv/bin/python -e ".[dev]" -c "$PINS"
  say "installed in $(( $(date +%s) - start )) s; .venv is $(du -sh .venv | cut -f1)"
  echo "$WANT" > "$STAMP"
fi

# 4. Tiny random checkpoints, a locally trained tokenizer and a skewed dataset (no hub).
.venv/bin/python tools/tiny_assets.py --out .assets >&2
