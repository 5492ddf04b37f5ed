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
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if labels is None and targets is None:  # no loss to fuse: the stock forward as it is
        outputs = patch.original_forward(**kwargs, return_dict=True)
        return _finish(self, patch, type(outputs), {**outputs}, return_dict)
    if targets is None:
        targets = shift_labels(labels)
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
    return _finish(self, patch, type(outputs), {**outputs, "loss": loss, "logits": logits}, return_dict)


def _finish(model, patch, output_type, fields: dict, return_dict: bool):
    """The output as stock builds it: the MoE auxiliary loss over data tokens (added to the loss
    when there is one: the stock forward adds it only when given labels), then dict or tuple."""
    router_logits = fields.get("router_logits")
    if fields.get("aux_loss") is not None and router_logits is not None:
        aux = router_aux_loss(model, patch, router_logits, fields["aux_loss"])
        fields["aux_loss"] = aux
        if fields.get("loss") is not None:
            fields["loss"] = fields["loss"] + _moe_setting(model, "router_aux_loss_coef") * aux.to(fields["loss"].device)
    result = output_type(**fields)
    return result if return_dict else result.to_tuple()


def router_aux_loss(model, patch, router_logits, stock_aux):
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
    return patch.family.load_balancing_loss()(
        router_logits, _moe_setting(model, "num_experts"), _moe_setting(model, "num_experts_per_tok"), mask
    )


def _moe_setting(model, name: str):
    """A router setting as the stock forward reads it: on the model (text LMs) or in its text config
    (the vision-language wrappers)."""
    value = getattr(model, name, None)
    return value if value is not None else getattr(model.config.get_text_config(), name)
