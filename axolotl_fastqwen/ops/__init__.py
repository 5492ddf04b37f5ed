"""Kernels behind the fused Qwen hybrid layers: one module per op.

Each op module holds its implementations (the fast library kernels: fla, causal-conv1d, PyTorch
varlen attention, Liger; and a boundary-correct fp32 PyTorch reference, which is both the CPU path
and the oracle of the self-check), its `BACKENDS`, and its `SPEC` (the reference and the
self-check's inputs at a model's head shapes). Layers never import a kernel library directly: they
call the op through the `KernelSet` chosen at patch time.
"""

from . import (causal_conv, gated_delta_rule, gated_rmsnorm, linear_cross_entropy, rms_norm, swiglu,
               varlen_attention)
from .backend import OpSpec

# in the order of the report's table
MODULES = (gated_delta_rule, causal_conv, gated_rmsnorm, varlen_attention, rms_norm, swiglu, linear_cross_entropy)
SPECS: dict[str, OpSpec] = {m.SPEC.name: m.SPEC for m in MODULES}
OPS = tuple(SPECS)


def check_op_names(names, key: str) -> None:
    """A preference naming no op would be silently unused: refuse it, listing the ops."""
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"{key}: unknown op(s) {unknown}; the ops are {', '.join(OPS)}")
