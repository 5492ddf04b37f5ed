"""The frozen projections' GEMM pairs (forward + input gradient) at one row's tokens, bf16 against
FP8, quantization included, for each weight shape of a model: what `fastqwen_fp8` decides on, and
what the two input-gradient layouts cost (a kept transposed copy, or one transposition per
backward). Also the quantization kernel alone and PyTorch's eager quantization (issue 35's 0.77-1.04x).

  python3 tools/gpu/fp8_gemm_timing.py --model qwen3.5-27b --tokens 8192 --out $OUT/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from axolotl_fastqwen.families.base import detect_family  # noqa: E402
from axolotl_fastqwen import registry  # noqa: E402
from axolotl_fastqwen.kernel_choice.fp8_decision import median_ms, self_check, time_shape  # noqa: E402
from axolotl_fastqwen.ops.availability import versions  # noqa: E402
from axolotl_fastqwen.ops.fp8_quantize import quantize_rows_reference, quantize_rows_triton  # noqa: E402
from axolotl_fastqwen.patching.fp8_weights import _role, candidates  # noqa: E402
from fastqwen_bench.shapes import build_config, get_shape  # noqa: E402


def model_shapes(name: str) -> dict[tuple[int, int], list[str]]:
    """Every candidate projection shape of the model (4 layers: both layer kinds), by role."""
    import transformers

    shape = get_shape(name)
    config = build_config(shape, 4)
    family = registry.family(shape.family)
    with torch.device("meta"):
        model = getattr(transformers, family.causal_lm)(config)
    model.requires_grad_(False)
    plan = detect_family(model, registry.families())
    decoders = [m for m in model.modules() if type(m) in plan.decoder]
    out: dict[tuple[int, int], list[str]] = {}
    for qualified, module in candidates(decoders).items():
        roles = out.setdefault(tuple(module.weight.shape), [])
        if _role(qualified) not in roles:
            roles.append(_role(qualified))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default="fp8_gemm.json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    rows = []
    for (n, k), roles in sorted(model_shapes(args.model).items()):
        w = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16)
        bf16, fp8_per_backward = time_shape(w, args.tokens, keep_transposed=False)
        _, fp8_kept = time_shape(w, args.tokens, keep_transposed=True)
        x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16)
        dy = torch.randn(args.tokens, n, device=device, dtype=torch.bfloat16)
        col = torch.rand(n, device=device) + 0.5
        quant = median_ms(lambda: (quantize_rows_triton(x), quantize_rows_triton(dy, col_scale=col)))
        eager = median_ms(lambda: (quantize_rows_reference(x), quantize_rows_reference(dy, col_scale=col)))
        kernel_vs_reference = {
            "x_scale_equal": bool(torch.equal(quantize_rows_triton(x)[1], quantize_rows_reference(x)[1])),
            "x_values_differing": float((quantize_rows_triton(x)[0].float() != quantize_rows_reference(x)[0].float())
                                        .float().mean()),
        }
        row = {"roles": roles, "n": n, "k": k, "tokens": args.tokens, "bf16_ms": bf16,
               "fp8_transposed_per_backward_ms": fp8_per_backward, "fp8_transposed_kept_ms": fp8_kept,
               "speedup_per_backward": bf16 / fp8_per_backward, "speedup_kept": bf16 / fp8_kept,
               "quantize_kernel_ms": quant, "quantize_eager_ms": eager,
               "selfcheck_error": self_check(w, False, torch.bfloat16), "kernel_vs_reference": kernel_vs_reference,
               "gemm_tflops_bf16": 4 * args.tokens * n * k / bf16 / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del w, x, dy
        torch.cuda.empty_cache()
    out = {"model": args.model, "gpu": torch.cuda.get_device_name(), "versions": versions(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
