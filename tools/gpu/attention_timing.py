"""Causal attention forward + backward at the 27B's full-attention shape (24 query heads, 4 key/value
heads, head dim 256), bf16, on rows of one long sequence and on a packed row: PyTorch's varlen
attention (what the plugin runs without flash-attn) against PyTorch's SDPA per sequence on each of
its fused backends (cuDNN, FlashAttention-2, memory-efficient), each checked against the varlen
output (issue 37, item 2).

  python3 tools/gpu/attention_timing.py --out $OUT/attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from axolotl_fastqwen.ops.availability import versions  # noqa: E402
from axolotl_fastqwen.ops.varlen_attention import torch_varlen  # noqa: E402

HQ, HKV, D = 24, 4, 256
BACKENDS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}


def varlen(q, k, v, cu):
    lengths = cu.diff()
    b = SimpleNamespace(cu_seqlens=cu.to(torch.int32), max_seqlen=int(lengths.max()))
    return torch_varlen(q, k, v, boundaries=b, scale=D**-0.5)


def per_sequence(backend):
    def run(q, k, v, cu):
        outs = []
        bounds = cu.tolist()
        with sdpa_kernel([backend]):
            for start, end in zip(bounds[:-1], bounds[1:]):
                qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=D**-0.5, enable_gqa=True)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
    return run


def timed(fn, q, k, v, cu, grad, reps):
    times, out = [], None
    for i in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(q, k, v, cu)
        out.backward(grad)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3, out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="packed-8192,16384,32768,65536,131072")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="attention.json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    results = []
    for row in args.rows.split(","):
        if row.startswith("packed-"):
            tokens = int(row.split("-")[1])
            lengths, left = [], tokens
            for n in (2048, 1500, 1024, 700, 512, 1200, 800, 408) * (tokens // 8192 + 1):
                if left <= 0:
                    break
                lengths.append(min(n, left))
                left -= lengths[-1]
        else:
            tokens, lengths = int(row), [int(row)]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(tokens, h, D, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
                   for h in (HQ, HKV, HKV))
        grad = torch.randn(tokens, HQ, D, device=device, generator=gen, dtype=torch.bfloat16)
        flops = sum(3 * 2 * n * n * HQ * D for n in lengths)  # causal: half of 4 L^2 H D forward; backward 2x
        entry = {"row": row, "tokens": tokens, "sequences": len(lengths), "backends": {}}
        ref_ms, ref_out, ref_grads = timed(varlen, q, k, v, cu, grad, args.reps)
        entry["backends"]["torch-varlen"] = {"ms": round(ref_ms, 2), "tflops": round(flops / ref_ms / 1e9, 1)}
        for name, backend in BACKENDS.items():
            try:
                ms, out, grads = timed(per_sequence(backend), q, k, v, cu, grad, args.reps)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape: recorded
                entry["backends"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            entry["backends"][name] = {
                "ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1), "x_varlen": round(ref_ms / ms, 3),
                "out_rel_err": rel(out, ref_out), "grad_rel_err": max(rel(g, r) for g, r in zip(grads, ref_grads))}
        print(json.dumps(entry), flush=True)
        results.append(entry)
        del q, k, v, grad
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "versions": versions(),
                                          "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                                          "heads": [HQ, HKV, D], "results": results}, indent=1))


if __name__ == "__main__":
    main()
