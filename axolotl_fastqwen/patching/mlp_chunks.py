"""Dense MLPs over chunks of a long row's tokens, each chunk recomputed in backward.

At long rows the MLP's intermediates dominate what a decoder layer holds: Qwen3.5-27B's gate and
up outputs and their SwiGLU product are three `[tokens, 17,408]` tensors against a hidden size of
5,120: 3.2 GiB in bf16 at 32k tokens, more than half of the 5.68 GiB a kept layer holds there
(issue 37); at 128k tokens a recomputed layer's backward rebuilds 12.8 GiB of them at once. The
MLP is per token, so a row can go through it in chunks of `chunk_tokens` with the same result (the Mini-Sequence Transformer's
observation, arXiv 2407.15892); each chunk runs under `torch.utils.checkpoint` (non-reentrant, so
it nests inside gradient checkpointing), which holds only the chunk's input and recomputes the
chunk's intermediates when its backward runs. A kept layer then holds no MLP intermediate and a
recomputed one never has more than a chunk's worth alive; the price is one more MLP forward in every
layer (a recomputed layer's recompute runs the chunks, whose own backward runs them again): 0.93x
at 16k-token rows on an H100, so a memory lever, not a speed one. Rows of at most `chunk_tokens`
tokens run the MLP as before.

Only the dense MLP (`layer.mlp` of a family without experts): a sparse MoE block's router outputs
are recorded per call for the auxiliary loss, which chunks would split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .instance_forward import replace_forward, restore_forward

KEY = "_fastqwen_mlp_chunks"  # where `replace_forward` keeps the MLP's own forward


class _ChunkedForward:
    """The instance forward of one MLP: the original one, per chunk, above `chunk` tokens."""

    def __init__(self, original, owner: MlpChunks):
        self.original, self.owner, self.chunk = original, owner, owner.chunk_tokens

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        if tokens <= self.chunk or args or kwargs:
            return self.original(x, *args, **kwargs)
        self.owner.chunked_forwards += 1
        flat = x.reshape(tokens, x.shape[-1])
        outs = []
        for start in range(0, tokens, self.chunk):
            part = flat[start:start + self.chunk].unsqueeze(0)  # [1, chunk, hidden]: the MLP's usual rank
            if torch.is_grad_enabled():
                outs.append(checkpoint(self.original, part, use_reentrant=False))
            else:
                outs.append(self.original(part))
        out = torch.cat(outs, dim=1)
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass
class MlpChunks:
    """The chunked MLPs of one model, and how to give their forwards back."""

    chunk_tokens: int
    modules: list[nn.Module] = field(default_factory=list)
    chunked_forwards: int = 0  # MLP forwards that ran in chunks

    @classmethod
    def install(cls, layers: list[nn.Module], chunk_tokens: int) -> MlpChunks:
        if chunk_tokens < 1:
            raise ValueError(f"mlp chunk_tokens must be positive, not {chunk_tokens}")
        self = cls(chunk_tokens=chunk_tokens)
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None or KEY in mlp.__dict__:
                continue
            replace_forward(mlp, KEY, lambda original: _ChunkedForward(original, self))
            self.modules.append(mlp)
        return self

    def restore(self) -> None:
        for mlp in self.modules:
            restore_forward(mlp, KEY)
        self.modules.clear()

    def to_dict(self) -> dict:
        return {"mlps": len(self.modules), "chunk_tokens": self.chunk_tokens,
                "chunked_forwards": self.chunked_forwards}
