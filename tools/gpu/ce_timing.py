"""fwd+bwd time and peak memory of the loss backends at Qwen3.5-27B's head (bf16, one H200).

    python3 tools/gpu/ce_timing.py OUT.json      (after `source tools/gpu/env.sh`)
"""
import json, sys, torch
from axolotl_fastqwen.ops.availability import version_of, versions
from axolotl_fastqwen.ops.linear_cross_entropy import liger_linear_cross_entropy, linear_cross_entropy

T, H, V = 8192, 5120, 248320
g = torch.Generator(device="cuda").manual_seed(0)
hidden = torch.randn(1, T, H, generator=g, device="cuda", dtype=torch.bfloat16)
weight = (torch.randn(V, H, generator=g, device="cuda") * 2 * H**-0.5).to(torch.bfloat16)
targets = torch.randint(0, V, (1, T), generator=g, device="cuda"); targets[0, ::7] = -100
out = {"liger_kernel": version_of("liger_kernel"), "versions": versions(), "command": sys.argv, "tokens": T, "hidden": H, "vocab": V}
for wgrad in (False, True):
    w = weight.clone().requires_grad_(wgrad)
    for name, fn in (("torch-chunked", linear_cross_entropy), ("liger", liger_linear_cross_entropy)):
        times = []
        for i in range(7):
            h = hidden.clone().requires_grad_()
            w.grad = None
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); loss = fn(h, w, targets); loss.backward(); e.record(); torch.cuda.synchronize()
            if i >= 2: times.append(s.elapsed_time(e))
        key = f"{name}{'+lm_head_grad' if wgrad else ''}"
        out[key] = {"ms_median": sorted(times)[len(times) // 2], "ms_all": times,
                    "peak_extra_GiB": (torch.cuda.max_memory_allocated() - base) / 2**30, "loss": float(loss)}
print(json.dumps(out, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
