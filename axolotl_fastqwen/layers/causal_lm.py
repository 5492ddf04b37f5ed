"""The causal-LM head with the loss fused in: logits are never materialised for a training loss.

The forward contract is transformers' own, with one documented difference:

* no labels: the stock forward runs unchanged (logits as stock computes them);
* labels, `model.train()`: the loss comes from the fused linear cross-entropy (defined exactly as
  `ForCausalLMLoss`), and `logits` is None, as with Liger's fused loss: skipping the vocabulary
  projection is the point;
* labels, `model.eval()` (a Trainer's `prediction_step`, `compute_metrics`), or the caller names
  `logits_to_keep`: the same logits stock returns, plus the fused loss;
* `return_dict=False` (argument or config): the tuple stock would return, loss first.

MoE families add the router's auxiliary loss as the stock forward does; over a packed row it counts
the row's data tokens only (not its padding or filler segments).
"""

from __future__ import annotations

import torch

from ..ops.linear_cross_entropy import shift_labels


def causal_lm_forward(self, *args, **kwargs):
    patch = self._fastqwen
    kwargs = patch.bind(args, kwargs)  # positional arguments by name, as the stock signature has them
    labels = kwargs.pop("labels", None)
    targets = kwargs.pop("shift_labels", None)
    if labels is None and targets is None:
        return patch.original_forward(**kwargs)
    if targets is None:
        targets = shift_labels(labels)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    keep = kwargs.pop("logits_to_keep", None)
    if keep is None and not self.training:
        keep = 0  # eval: every position's logits, as stock returns them

    captured = {}
    handle = self.model.register_forward_hook(lambda module, inputs, output: captured.__setitem__("out", output))
    try:
        kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long)  # the stock head projects nothing
        outputs = patch.original_forward(**kwargs, return_dict=True)
    finally:
        handle.remove()
    hidden = captured["out"].last_hidden_state
    loss = patch.context.loss(
        patch.kernels.linear_cross_entropy, hidden, self.lm_head.weight, targets,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
    )
    logits = None
    if keep is not None:
        index = slice(-keep, None) if isinstance(keep, int) else keep
        logits = self.lm_head(hidden[:, index, :])

    fields = {**outputs, "loss": loss, "logits": logits}
    router_logits = getattr(outputs, "router_logits", None)
    if getattr(outputs, "aux_loss", None) is not None and router_logits is not None:
        # the stock forward computed it (output_router_logits) but adds it only when given labels
        aux = router_aux_loss(self, patch, router_logits, kwargs.get("attention_mask"), outputs.aux_loss)
        fields["aux_loss"] = aux
        fields["loss"] = loss + _moe_setting(self, "router_aux_loss_coef") * aux.to(loss.device)
    result = type(outputs)(**fields)
    return result if return_dict else result.to_tuple()


def router_aux_loss(model, patch, router_logits, attention_mask, stock_aux):
    """The load-balancing loss over the batch's data tokens.

    Unpacked batches: stock's value. Packed rows: stock's function with a 0/1 mask of the row's
    data tokens (stock would count the padding tail, and would weight Axolotl's per-sequence mask
    ids 2, 3, ... as token counts); 0 for a row that holds no data at all.
    """
    boundaries = patch.context.last_boundaries
    if boundaries is None:
        return stock_aux
    if len(boundaries.padding_segments) == boundaries.num_sequences:
        return torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    mask = boundaries.real_token_mask()
    return patch.family.module().load_balancing_loss_func(
        router_logits, _moe_setting(model, "num_experts"), _moe_setting(model, "num_experts_per_tok"), mask
    )


def _moe_setting(model, name: str):
    """A router setting as the stock forward reads it: on the model (text LMs) or in its text config
    (the vision-language wrappers)."""
    value = getattr(model, name, None)
    return value if value is not None else getattr(model.config.get_text_config(), name)
