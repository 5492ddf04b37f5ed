"""Kernels behind the fused Qwen hybrid layers.

One module per op. Each offers the fast library kernels (fla, causal-conv1d, PyTorch varlen
attention) and a boundary-correct fp32 PyTorch reference, which is both the CPU path and the
oracle of the self-check. Layers never import a kernel library directly: they call these ops with
a backend name chosen once, at patch time.
"""
