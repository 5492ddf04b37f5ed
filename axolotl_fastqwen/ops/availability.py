"""Which kernel libraries are importable here, and at which version.

Import is not enough to use a kernel (fla imports on a CPU machine and crashes at the first
launch), so this module only answers "is it installed"; `selfcheck` answers "does it work".
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

import torch

# Distribution name for each importable package we may use.
DISTRIBUTIONS = {
    "fla": "fla-core",
    "causal_conv1d": "causal-conv1d",
    "flash_attn": "flash-attn",
    "triton": "triton",
    "liger_kernel": "liger-kernel",
}


@functools.cache
def version_of(package: str) -> str | None:
    """Installed version of `package` (import name), or None when it is absent or broken."""
    dist = DISTRIBUTIONS.get(package, package)
    try:
        importlib.import_module(package)
    except Exception:  # a broken install (missing CUDA extension, wrong torch ABI) counts as absent
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        module = importlib.import_module(package)
        return getattr(module, "__version__", "unknown")


def has_fla() -> bool:
    return version_of("fla") is not None


def has_causal_conv1d() -> bool:
    if version_of("causal_conv1d") is None:
        return False
    try:  # the Python package installs without its CUDA extension on CPU-only builds
        importlib.import_module("causal_conv1d_cuda")
    except Exception:
        return False
    return True


def has_flash_attn() -> bool:
    return version_of("flash_attn") is not None


def has_liger() -> bool:
    """Liger-Kernel's fused linear cross-entropy (Triton; imports on CPU too, runs on CUDA only)."""
    return version_of("liger_kernel") is not None


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
    for package in ("triton", "fla", "causal_conv1d", "flash_attn", "liger_kernel", "peft", "axolotl"):
        out[package] = version_of(package)
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out
