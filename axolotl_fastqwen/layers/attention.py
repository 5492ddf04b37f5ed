"""Gated full attention over a packed row: varlen kernels, no T x T mask, no cross-sequence reads.

Same math as the stock layer (q and output gate from one projection, zero-centred q/k RMSNorm,
partial rotary, sigmoid output gate), with the attention call replaced by a varlen kernel over
the boundaries resolved for the whole forward. Unpacked batches and generation keep the stock path.
"""

from __future__ import annotations

import torch

from ..boundaries import BOUNDARIES_KWARG, cache_of
from ..memory.lean_activations import recomputable


def attention_forward(self, hidden_states, position_embeddings, *args, **kwargs):
    patch = self._fastqwen
    boundaries = kwargs.get(BOUNDARIES_KWARG)
    if boundaries is None or cache_of(kwargs) is not None or args:
        # unpacked or generation batches: the stock forward, with its arguments as given
        return patch.original_forward(hidden_states, position_embeddings, *args, **kwargs)
    batch, seq_len, _ = hidden_states.shape
    x = hidden_states.reshape(1, batch * seq_len, -1)
    tokens = x.shape[1]
    apply_qkv = getattr(self, "apply_qkv", None)  # Axolotl's lora_qkv_kernel, if attached
    q, k, v = apply_qkv(x) if apply_qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
    query, gate = torch.chunk(q.view(1, tokens, -1, 2 * self.head_dim), 2, dim=-1)
    gate = gate.reshape(1, tokens, -1)
    query = self.q_norm(query)
    key = self.k_norm(k.view(1, tokens, -1, self.head_dim))
    value = v.view(1, tokens, -1, self.head_dim)

    cos, sin = position_embeddings
    cos, sin = cos.reshape(1, tokens, -1), sin.reshape(1, tokens, -1)
    # [1, T, H, D] layout: heads on dim 2, so the varlen kernels get [T, H, D] without a transpose
    query, key = patch.family.rotary()(query, key, cos, sin, unsqueeze_dim=2)

    out = patch.kernels.varlen_attention(
        query[0], key[0], value[0], boundaries=boundaries, scale=self.scaling,
        dropout=self.attention_dropout if self.training else 0.0,
    )
    # recomputable: o_proj's LoRA saves the gated output, which mul's own saved operands give back
    out = recomputable(torch.mul, out.reshape(1, tokens, -1), torch.sigmoid(gate))
    o_proj = getattr(self, "apply_o", None) or self.o_proj  # Axolotl's lora_o_kernel, if attached
    return o_proj(out).reshape(batch, seq_len, -1), None
