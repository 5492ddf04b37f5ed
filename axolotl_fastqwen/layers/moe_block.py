"""The sparse MoE block of Qwen3.5-MoE and Qwen3-Next with its shared expert's term added inside the
routed experts' sum.

transformers' block computes the shared expert, the router and the routed experts, then
`routed + sigmoid(shared_expert_gate(x)) · shared`: a multiply and an add over `[tokens, hidden]`
forward, and two multiplies, a reduction and the sigmoid's backward in the gradient, each a kernel
of its own on every layer. When the routed experts run `fastqwen_grouped` (`grouped_experts.py`), the
block hands them the shared expert's output and its gate's logits instead: the term is one more read
in the kernel that already sums each token's routed rows, and its gradients one pass
(`ops/routed_combine.py`). The same modules run in the same order as transformers' (so hooks, the
router's recorded logits for the auxiliary loss, and LoRA on the shared expert are unchanged). Where
the experts run anything else, the block's own forward runs.
"""

from __future__ import annotations

import torch

from .grouped_experts import SharedExpert, takes_shared_expert


# set True on a block to run transformers' forward (bench path C: the routed rows as before the kernels)
OWN_FORWARD_ATTR = "_fastqwen_block_own_forward"


def sparse_moe_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.__dict__.get(OWN_FORWARD_ATTR) or not takes_shared_expert(self.experts):
        return self._fastqwen.original_forward(hidden_states)
    batch, length, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    shared = self.shared_expert(x)
    _, routing_weights, selected_experts = self.gate(x)
    out = self.experts(x, selected_experts, routing_weights,
                       shared_expert=SharedExpert(shared, self.shared_expert_gate(x)))
    return out.reshape(batch, length, hidden)
