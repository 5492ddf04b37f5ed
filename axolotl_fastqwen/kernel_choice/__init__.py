"""Kernel choice for one model: selection (`selection.py`), the GPU self-check (`selfcheck.py`) and
fla's Hopper guard (`hopper_guard.py`). The kernels themselves live with their ops (`ops/`)."""

from ..ops.backend import CheckShapes, KernelBackend
from .selection import KernelChoice, KernelSet, KernelUnavailableError, MODES, enforce_mode, reference_backend, select_kernels
from .selfcheck import TOLERANCE, bind, check_inputs, compare, selfcheck

__all__ = [
    "CheckShapes", "KernelBackend", "KernelChoice", "KernelSet", "KernelUnavailableError", "MODES", "TOLERANCE",
    "bind", "check_inputs", "compare", "enforce_mode", "reference_backend", "select_kernels", "selfcheck",
]
