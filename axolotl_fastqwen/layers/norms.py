"""The decoder's zero-centred RMSNorms through the `rms_norm` op: Liger's one kernel each way on a
GPU, transformers' own math elsewhere (ops/rms_norm.py)."""

from __future__ import annotations

import torch


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self._fastqwen.kernels.rms_norm(x, self.weight, eps=self.eps)
