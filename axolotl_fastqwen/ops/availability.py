"""Which kernel libraries are installed here, at which version, and whether they import.

Versions are read from package metadata without importing anything: importing fla on a machine
without a GPU prints Triton warnings, so a kernel package is imported only by the `has_*` checks,
which kernel selection calls for a CUDA device alone. Import is still not enough to use a kernel
(fla imports on a CPU machine and crashes at the first launch): `selfcheck` answers "does it work".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import shutil
import subprocess

import torch

# How to get fla: on PyPI under this name, and in this package's `[kernels]` extra (README, "Install").
FLA_HINT = "pip install 'flash-linear-attention>=0.5.2', in the [kernels] extra"
# Liger-Kernel: a dependency of this package (and of Axolotl); missing only from a hand-made environment.
LIGER_HINT = "pip install liger-kernel"

# Triton: PyTorch's CUDA wheels bring it; missing only from a CPU-only or hand-made environment.
TRITON_HINT = "pip install triton (PyTorch's CUDA wheels include it)"

# FlashQLA (QwenLM's TileLang GDN kernels): opt-in, `fastqwen_kernel_preference` (README, "Kernels").
FLASH_QLA_HINT = "pip install flash-qla (TileLang; SM90/SM100 GPUs)"

# Distribution name for each importable package we may use.
DISTRIBUTIONS = {
    "fla": "fla-core",
    "causal_conv1d": "causal-conv1d",
    "flash_attn": "flash-attn",
    "triton": "triton",
    "liger_kernel": "liger-kernel",
    "flash_qla": "flash-qla",
}


@functools.cache
def version_of(package: str) -> str | None:
    """Installed version of `package` (import name), or None when it is absent. Imports nothing."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(package, package))
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def importable(package: str) -> bool:
    """Whether `package` imports (a broken install, e.g. a missing CUDA extension or a torch ABI
    mismatch, does not). Imports it: call only where its kernels can run."""
    if version_of(package) is None:
        return False
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def has_fla() -> bool:
    return importable("fla")


def has_causal_conv1d() -> bool:
    # the Python package installs without its CUDA extension on CPU-only builds
    return importable("causal_conv1d") and importable("causal_conv1d_cuda")


def has_flash_attn() -> bool:
    return importable("flash_attn")


def has_flash_qla() -> bool:
    """FlashQLA imports only where TileLang finds a GPU it has kernels for (SM90, SM100/103, SM120)."""
    return importable("flash_qla")


def has_liger() -> bool:
    """Liger-Kernel's fused linear cross-entropy (Triton; imports on CPU too, runs on CUDA only)."""
    return importable("liger_kernel")


def has_triton() -> bool:
    return importable("triton")


def has_torch_varlen() -> bool:
    """PyTorch's own varlen attention (torch>=2.10, CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def versions() -> dict[str, str | None]:
    """Versions that decide kernel behaviour; recorded in every report and benchmark JSON."""
    import transformers

    out: dict[str, str | None] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    for package in ("triton", "fla", "causal_conv1d", "flash_attn", "liger_kernel", "flash_qla", "tilelang", "peft",
                    "axolotl"):
        out[package] = version_of(package)
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out


def driver_version() -> str | None:
    """The NVIDIA driver, from nvidia-smi, else NVML (torch does not expose it)."""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )
            return out.stdout.strip().splitlines()[0]
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    return None
