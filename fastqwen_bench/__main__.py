"""`python -m fastqwen_bench bench|profile ...`, from a checkout of the repository."""

from __future__ import annotations

from axolotl_fastqwen.__main__ import main

COMMANDS = {
    "bench": ("fastqwen_bench.run", "every training path side by side on one model and token stream"),
    "profile": ("fastqwen_bench.profile",
                "torch.profiler trace of one path: top kernels, GPU idle gaps, launches by issuing op"),
}

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m fastqwen_bench", commands=COMMANDS))
