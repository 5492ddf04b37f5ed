"""An autograd function with a known launch makeup, for the launch-census tests (CPU and GPU).

Forward: an upcast copy and a mul inside the function's record ("Scale"); backward: a mul and a
downcast copy inside its node ("ScaleBackward").
"""

from __future__ import annotations

import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.float().mul(2.0)

    @staticmethod
    def backward(ctx, g):
        return g.mul(2.0).to(torch.bfloat16)
