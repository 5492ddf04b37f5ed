"""The benchmark of the fused Qwen hybrid path: every training path side by side (`run.py`, paths in
`paths.py`, Axolotl's fastest configuration re-created by Axolotl's own functions in
`axolotl_best.py`), and its profile (`profile.py`). Not part of the installed package: run it from a
checkout, `python -m fastqwen_bench bench|profile ...`. One process builds one random-weight model
and runs every path on the same token stream, so the numbers differ only by what each path does:
kernels, batch layout, patches. Results live in benchmarks/.
"""
