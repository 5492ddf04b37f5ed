"""Assemble transformers' test tree for the installed transformers version, in an ignored cache.

    python assemble.py CACHE_DIR [--checkout PATH] [--clone]   # prints the assembled root

The PyPI sdist of transformers ships only the top-level `tests/*.py` (test_modeling_common.py,
test_configuration_common.py, the mixins); `tests/models/`, `tests/generation/`,
`tests/causal_lm_tester.py`, `utils/test_module/` and the root `conftest.py` are only in the git
repository. So:

1. the sdist of exactly the installed version is downloaded from PyPI (hash-checked against the
   index) and its `tests/*.py` extracted;
2. the rest comes from a transformers checkout: `--checkout PATH` (or $TRANSFORMERS_TESTS), else
   `--clone` makes a sparse, shallow clone of tag v<version> from GitHub;
3. the tree is assembled as CACHE_DIR/transformers-<version>/{conftest.py,pyproject.toml,tests,utils}
   with the sdist's top-level files laid over the checkout's, and `src/transformers` linked to the
   installed package (some test modules read its files). provenance.json records what came from where,
   and which top-level files of the checkout differ from the release (none, for a v<version> checkout).

Nothing here is committed: CACHE_DIR is ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request

INDEX = os.environ.get("PYPI_SIMPLE_URL", "https://pypi.org/simple")
REPO = os.environ.get("TRANSFORMERS_GIT_URL", "https://github.com/huggingface/transformers")
FROM_CHECKOUT = ("conftest.py", "pyproject.toml", "tests", "utils")


def sdist(version: str, cache: str) -> tuple[str, str]:
    """Download transformers-<version>.tar.gz from the PyPI simple index (JSON API), hash-checked."""
    name = f"transformers-{version}.tar.gz"
    path = os.path.join(cache, name)
    req = urllib.request.Request(f"{INDEX}/transformers/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    match = [f for f in files if f["filename"] == name]
    if not match:
        raise SystemExit(f"{name} is not on {INDEX}")
    sha = match[0]["hashes"]["sha256"]
    if not (os.path.exists(path) and _sha256(path) == sha):
        tmp = path + ".part"
        with urllib.request.urlopen(match[0]["url"], timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        if _sha256(tmp) != sha:
            raise SystemExit(f"{name}: sha256 mismatch")
        os.replace(tmp, path)
    return path, sha


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def clone(version: str, cache: str) -> str:
    dest = os.path.join(cache, f"transformers-git-v{version}")
    if not os.path.isdir(os.path.join(dest, "tests")):
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["git", "clone", "--depth", "1", "--branch", f"v{version}", "--filter=blob:none", "--sparse",
                        REPO, dest], check=True)
        subprocess.run(["git", "-C", dest, "sparse-checkout", "set", "tests", "utils"], check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache")
    ap.add_argument("--checkout", default=os.environ.get("TRANSFORMERS_TESTS"))
    ap.add_argument("--clone", action="store_true")
    args = ap.parse_args()

    import transformers

    version = transformers.__version__
    cache = os.path.abspath(args.cache)
    os.makedirs(cache, exist_ok=True)
    tarball, sha = sdist(version, cache)

    if args.checkout:
        checkout, source = os.path.abspath(args.checkout), f"checkout {os.path.abspath(args.checkout)}"
    elif args.clone:
        checkout = clone(version, cache)
        source = f"git clone {REPO} v{version}"
    else:
        raise SystemExit(
            "transformers' sdist has no tests/models: set TRANSFORMERS_TESTS=/path/to/a/transformers/checkout "
            f"(ideally tag v{version}) or pass --clone to clone it from {REPO}"
        )
    if not os.path.isdir(os.path.join(checkout, "tests", "models")):
        raise SystemExit(f"{checkout}: no tests/models (want the root of a transformers checkout)")
    head = ""
    if os.path.isdir(os.path.join(checkout, ".git")):
        head = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    root = os.path.join(cache, f"transformers-{version}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for name in FROM_CHECKOUT:
        src = os.path.join(checkout, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(root, name), ignore=shutil.ignore_patterns("__pycache__"))
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(root, name))

    overrides, added = [], []
    prefix = f"transformers-{version}/tests/"
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            rel = member.name[len(prefix):] if member.name.startswith(prefix) else None
            if not rel or "/" in rel or not member.isfile():
                continue
            data = tar.extractfile(member).read()
            dest = os.path.join(root, "tests", rel)
            if os.path.exists(dest):
                with open(dest, "rb") as f:
                    if f.read() != data:
                        overrides.append(rel)
            else:
                added.append(rel)
            with open(dest, "wb") as f:
                f.write(data)
    os.makedirs(os.path.join(root, "src"), exist_ok=True)
    os.symlink(os.path.dirname(transformers.__file__), os.path.join(root, "src", "transformers"))

    provenance = {
        "transformers": version,
        "sdist": os.path.basename(tarball),
        "sdist_sha256": sha,
        "tests_source": source + (f" @ {head}" if head else ""),
        "sdist_overrides": sorted(overrides),
        "sdist_added": sorted(added),
    }
    with open(os.path.join(root, "provenance.json"), "w") as f:
        json.dump(provenance, f, indent=1)
    if overrides:
        print(f"note: {len(overrides)} top-level test file(s) of the checkout differ from the v{version} sdist "
              f"(the checkout is not v{version}); the sdist's are used: {', '.join(sorted(overrides))}", file=sys.stderr)
    print(root)


if __name__ == "__main__":
    main()
