"""Upstream-compat matrix: the test suite against the stacks our users run.

    nox -f tools/noxfile.py -l          # list the cells
    nox -f tools/noxfile.py -s latest   # run one
    nox -f tools/noxfile.py -t ci       # the cells CI runs (tools/test.sh calls this)

Each cell is a fresh uv environment. The README's compatibility table records what each cell
last gave.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent
REQ = ROOT / "tools" / "requirements"
nox.options.default_venv_backend = "uv"
nox.options.envdir = str(ROOT / ".nox")
nox.options.reuse_existing_virtualenvs = True
PYTHON = os.environ.get("FASTQWEN_PYTHON") or "3.12"
ENV = {
    "AXOLOTL_DO_NOT_TRACK": "1",
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _pytest(session: nox.Session, *default: str) -> None:
    session.chdir(ROOT)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *(session.posargs or default), env=ENV)


@nox.session(name="axolotl-0.21", python=PYTHON, tags=["ci"])
def axolotl_021(session: nox.Session) -> None:
    """Axolotl 0.21.0 with the stack it pins: transformers 5.20.1, peft 0.21.2, fla 0.5.2."""
    session.install("-e", f"{ROOT}[dev]", "-c", str(REQ / "axolotl-0.21.txt"))
    _pytest(session)


def _without_axolotl(session: nox.Session, requirements: str) -> None:
    """The package (no dependency resolution: Axolotl cannot join these stacks) on a pinned stack;
    the tests that run Axolotl skip themselves, everything else runs."""
    session.install("-r", str(REQ / requirements))
    session.install("--no-deps", "-e", str(ROOT))
    _pytest(session, "-m", "not axolotl")


@nox.session(name="latest", python=PYTHON, tags=["ci"])
def latest(session: nox.Session) -> None:
    """The newest installable torch (2.15.0), transformers (5.25.0) and fla (0.6.0): the layers, kernels and
    packer, no Axolotl."""
    _without_axolotl(session, "latest.txt")


@nox.session(name="transformers-5.17", python=PYTHON, tags=["ci"])
def transformers_517(session: nox.Session) -> None:
    """The H200 image's stack: transformers 5.17.0, peft 0.21.0, fla 0.6.0, no Axolotl."""
    _without_axolotl(session, "transformers-5.17.txt")


@nox.session(name="wheel", python=PYTHON, tags=["ci"])
def wheel(session: nox.Session) -> None:
    """The built wheel (not the checkout) installed beside Axolotl 0.21's stack in a fresh environment,
    `axolotl train` of the tiny demo config with it; the wheel and sdist contents and `twine check`."""
    dist = Path(session.create_tmp()) / "dist"
    session.install("build>=1.2", "twine>=6", "uv>=0.9")
    session.run("python", "-m", "build", "--installer", "uv", "--wheel", "--sdist", "--outdir", str(dist), str(ROOT))
    session.run("twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    built = next(dist.glob("*.whl"))
    session.install(f"{built}", "pytest>=8", "pyyaml", "-c", str(REQ / "axolotl-0.21.txt"))
    session.chdir(session.create_tmp())  # not the repository: the import must find the wheel
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                "-c", str(ROOT / "pyproject.toml"), str(ROOT / "tests" / "test_installed_wheel.py"), env=ENV)


@nox.session(name="axolotl-0.21-transformers-5.24", python=PYTHON)
def axolotl_021_transformers_524(session: nox.Session) -> None:
    """Axolotl 0.21.0 forced onto transformers 5.24.0 and fla 0.6.0 (what an upgrading user gets);
    not in CI: Axolotl supports only its pinned transformers."""
    session.install("-e", f"{ROOT}[dev]", "-c", str(REQ / "axolotl-0.21.txt"), "--override",
                    str(REQ / "axolotl-0.21-transformers-5.24.txt"))
    _pytest(session)
