"""CPU stand-ins for the two fla entry points Axolotl's packing patches call (CPU smoke runs only).

Axolotl's Qwen3.5 / Qwen3-Next packing patches call fla's Triton `causal_conv1d` and
`chunk_gated_delta_rule` with `cu_seqlens`, and refuse to run without them. fla's kernels need a
GPU, so on a CPU run paths axolotl-packing and axolotl-best would fail at their first forward.
For a CPU smoke test only, these functions take fla's signatures and run each packed sequence
alone through transformers' own PyTorch fallbacks (the math of path stock-torch-padded); the
path's record says so. A GPU run never uses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axolotl_fastqwen.transformers_functions import modeling_module, torch_fallback

NAMES = ("fla_causal_conv1d", "fla_chunk_gated_delta_rule")


def _segments(cu_seqlens, length: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, length)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
    """fla.modules.convolution.causal_conv1d: x [B, T, D], weight [D, W] -> ([B, T, D], None)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    rows = []
    for b in range(B):
        parts = []
        for s, e in _segments(cu_seqlens, T):
            seg = x[b, s:e].transpose(0, 1).unsqueeze(0)  # [1, D, L]
            y = F.conv1d(F.pad(seg, (W - 1, 0)), weight.unsqueeze(1), bias, groups=D)
            parts.append(y[0].transpose(0, 1))
        rows.append(torch.cat(parts, dim=0))
    out = torch.stack(rows)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out, None


def chunk_gated_delta_rule_for(family: str):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule over [B, T, H, D] inputs, one packed
    sequence at a time through `family`'s modeling file's `torch_chunk_gated_delta_rule`."""
    module = modeling_module(family)
    rule = torch_fallback(module.torch_chunk_gated_delta_rule, "torch_chunk_gated_delta_rule")

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        if initial_state is not None or output_final_state:
            raise NotImplementedError("CPU stand-in: training only (no recurrent state)")
        parts = []
        for s, e in _segments(cu_seqlens, q.shape[1]):
            out, _ = rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            parts.append(out)
        return torch.cat(parts, dim=1).to(v.dtype), None

    return chunk_gated_delta_rule


def install(undo, patch_module, family: str) -> str | None:
    """On a CPU run, point Axolotl's `patch_module` at the stand-ins (restored by `undo`)."""
    if not all(hasattr(patch_module, n) for n in NAMES):
        return None
    undo.module(patch_module)
    patch_module.fla_causal_conv1d = causal_conv1d
    patch_module.fla_chunk_gated_delta_rule = chunk_gated_delta_rule_for(family)
    return (f"CPU smoke run: {patch_module.__name__}.{{{', '.join(NAMES)}}} (fla Triton kernels) stood in by "
            "per-sequence PyTorch fallbacks (bench/cpu_fla.py); not a measurement of Axolotl's kernels")
