"""The dense SwiGLU MLP (Qwen3.5's, Qwen3-Next's dense layers, and the MoE families' shared expert):
`down(silu(gate(x)) · up(x))`, with `silu(gate) · up` as one op (`ops/swiglu.py`) that holds gate and
up alone, and the product marked recomputable from them: down_proj's LoRA saves its input, which a
lean kept layer (memory/lean_activations.py) then rebuilds in backward instead of holding. Same math
as the stock forward; the projections run as they are (peft, the fused LoRA, FP8)."""

from __future__ import annotations

import torch

from ..memory.lean_activations import recomputable


def swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    product = recomputable(self._fastqwen.kernels.swiglu, self.gate_proj(x), self.up_proj(x))
    return self.down_proj(product)


def runs_silu(module) -> bool:
    """transformers' SiLU activation (`hidden_act: silu`): the function the swiglu op computes."""
    return type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")
