"""The causal-LM head with the loss fused in: logits are never materialised when labels are given.

The stock forward runs unchanged except that it is asked for zero logits (`logits_to_keep` = an
empty index) and no labels; the final hidden states are taken from the decoder's output and the
loss is computed by the chunked linear cross-entropy, as `ForCausalLMLoss` defines it. MoE
families add their router auxiliary loss exactly as the stock forward does.
"""

from __future__ import annotations

import torch

from ..ops.linear_cross_entropy import shift_labels


def causal_lm_forward(self, *args, labels=None, **kwargs):
    patch = self._fastqwen
    targets = kwargs.pop("shift_labels", None)
    if labels is None and targets is None:
        return patch.original_forward(*args, **kwargs)
    if targets is None:
        targets = shift_labels(labels)

    captured = {}
    decoder = self.model
    handle = decoder.register_forward_hook(lambda module, inputs, output: captured.__setitem__("out", output))
    try:
        kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long)
        outputs = patch.original_forward(*args, **kwargs)
    finally:
        handle.remove()
    hidden = captured["out"].last_hidden_state
    loss = patch.kernels.linear_cross_entropy(
        hidden, self.lm_head.weight, targets, num_items_in_batch=kwargs.get("num_items_in_batch")
    )
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is not None:  # MoE: the stock forward adds it only when labels are given
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    # Rebuilt so that `loss` is the first field, as in every stock output; `logits` stays the empty
    # [B, 0, V] tensor the stock forward produced, saying truthfully that none were computed.
    return type(outputs)(**{**outputs, "loss": loss})
