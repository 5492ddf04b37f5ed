"""Benchmarks, profiling and environment checks for the fused Qwen hybrid path.

`python -m axolotl_fastqwen bench|profile|doctor` (console script `axolotl-fastqwen`). One process
builds one random-weight model and runs every training path on the same token stream, so the
numbers differ only by what each path does: kernels, batch layout, patches.
"""
