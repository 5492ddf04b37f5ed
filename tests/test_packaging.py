"""The distributions: a wheel and an sdist that hold the package alone and pass `twine check`.

Built with PyPA's `build` (its isolated build environment installed by uv, from the package index);
the `wheel` matrix cell then installs that wheel beside Axolotl and trains with it
(tests/test_installed_wheel.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    import importlib.metadata

    for tool in ("build", "twine"):  # by distribution: a stray `build/` folder would import as `build`
        try:
            importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{tool} is not installed here (the dev extra has it)")
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # uv for build's isolated env
    done = subprocess.run([sys.executable, "-m", "build", "--installer", "uv", "--sdist", "--wheel", "--outdir",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "deprecated" not in done.stdout + done.stderr, "setuptools warns about the project metadata"
    return next(out.glob("*.whl")), next(out.glob("*.tar.gz"))


def test_the_wheel_holds_the_package_alone(dists):
    wheel, _ = dists
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"axolotl_fastqwen", "axolotl_fastqwen-0.1.0.dist-info"}, tops
    assert "axolotl_fastqwen/integration/plugin.py" in names and "axolotl_fastqwen/diagnostics/doctor.py" in names
    assert not [n for n in names if "bench" in n], "the benchmark is not part of the installed package"
    entry_points = zipfile.ZipFile(wheel).read("axolotl_fastqwen-0.1.0.dist-info/entry_points.txt").decode()
    assert "[axolotl.plugins]" in entry_points and "axolotl_fastqwen = axolotl_fastqwen:FastQwenPlugin" in entry_points


def test_the_sdist_holds_the_package_alone(dists):
    _, sdist = dists
    names = [n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n]
    tops = {n.split("/")[0] for n in names}
    assert tops == {"axolotl_fastqwen", "axolotl_fastqwen.egg-info", "PKG-INFO", "README.md", "pyproject.toml",
                    "setup.cfg"}, tops


def test_twine_accepts_both(dists):
    done = subprocess.run([str(BIN / "twine"), "check", "--strict", *map(str, dists)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("PASSED") == 2, done.stdout + done.stderr
