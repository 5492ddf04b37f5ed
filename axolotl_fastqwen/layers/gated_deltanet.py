"""The Gated DeltaNet forward: projections -> boundary-exact conv -> gated delta rule -> gated norm.

It calls the layer's own submodules (`in_proj_*`, `out_proj`), so peft LoRA wrappers on them keep
working (and Axolotl's fused LoRA projections, `apply_in_proj_fused` / `apply_out_proj`, where its
`lora_qkv_kernel` / `lora_o_kernel` attached them), and takes the kernels and the batch's
boundaries from outside: kernels chosen at patch time, boundaries resolved once per forward by the
model-level hook.
"""

from __future__ import annotations

import torch

from ..boundaries import BOUNDARIES_KWARG, cache_of
from ..memory.lean_activations import recomputable
from ..transformers_functions import stock_kernels_on_cpu


def gated_deltanet_forward(self, hidden_states: torch.Tensor, **kwargs):
    patch = self._fastqwen
    if cache_of(kwargs) is not None:
        # Generation with a recurrent cache (prefill + decode) keeps the stock path; on a CPU on
        # transformers' own PyTorch functions (the fla kernels it resolved at import would crash).
        with stock_kernels_on_cpu(patch.family.module, hidden_states.device):
            return patch.original_forward(hidden_states, **kwargs)
    attention_mask = kwargs.get("attention_mask")
    kernels = patch.kernels
    boundaries = kwargs.get(BOUNDARIES_KWARG)
    batch, seq_len, _ = hidden_states.shape
    if boundaries is None:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            # padded rows, as stock: padding tokens carry no signal into the conv or the state
            hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
    elif batch != 1:
        hidden_states = hidden_states.reshape(1, batch * seq_len, -1)  # packed rows: one stream

    mixed_qkv, z, b, a = patch.family.project_gated_deltanet(self, hidden_states)
    mixed_qkv = kernels.causal_conv(
        mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation, boundaries=boundaries
    )
    rows, tokens = mixed_qkv.shape[:2]
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(rows, tokens, self.num_k_heads, self.head_k_dim)
    key = key.reshape(rows, tokens, self.num_k_heads, self.head_k_dim)
    value = value.reshape(rows, tokens, self.num_v_heads, self.head_v_dim)

    core = kernels.gated_delta_rule(query, key, value, a, b, self.A_log, self.dt_bias, boundaries=boundaries)
    # recomputable: out_proj's LoRA saves its input; under lean activations a kept layer drops it
    normed = recomputable(_gated_norm_rows, kernels.gated_rmsnorm, core, z, self.norm.weight,
                          self.norm.variance_epsilon, rows, tokens)
    out_proj = getattr(self, "apply_out_proj", None) or self.out_proj  # Axolotl's lora_o_kernel, if attached
    output = out_proj(normed)
    return output.reshape(batch, seq_len, -1)


def _gated_norm_rows(gated_rmsnorm, core, z, weight, eps, rows, tokens):
    """The gated norm's output as out_proj reads it, [rows, tokens, value_dim]: one function, so that
    what lean activations recompute is the very tensor out_proj saved (a copy where the reshape
    of a non-contiguous output copies)."""
    return gated_rmsnorm(core, z, weight, eps=eps).reshape(rows, tokens, -1)
