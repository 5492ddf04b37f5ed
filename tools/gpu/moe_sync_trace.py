"""Where the MoE training step waits on the host: every CUDA->host sync of one warm step, by call site.

Issue 13: at the 35B-A3B shape the plugin's step is 71% GPU-busy (357 ms idle of 1,240 ms). This
runs the plugin's bench setup (random weights, LoRA r=16 on the bench's targets, one packed
8,192-token row, bf16 autocast) at a reduced depth, warms up, then runs one step under
`torch.cuda.set_sync_debug_mode("warn")` and records each sync warning's stack (frames inside
transformers, peft, fla, liger, axolotl_fastqwen, torch.nn), counted per distinct site. Syncs in
the backward run on autograd's C++ threads and carry no Python stack there: they are not seen.

    python3 tools/gpu/moe_sync_trace.py OUT.json [--model qwen3.5-35b-a3b] [--layers 4] [--gc]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

import torch

from axolotl_fastqwen import patch_model
from fastqwen_bench import data
from fastqwen_bench.shapes import build_config, build_model, get_shape, lora_targets

KEEP = ("transformers/", "peft/", "fla/", "liger_kernel/", "axolotl_fastqwen/", "torch/nn/", "torch/utils/checkpoint")


def step(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**batch)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--gc", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    shape = get_shape(args.model)
    config = build_config(shape, args.layers)
    model, _ = build_model(config, shape.family, device, torch.bfloat16, 0)
    from peft import LoraConfig, get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=lora_targets(shape.family)))
    if args.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    report = patch_model(model)
    w = data.make_workload(budget=args.budget, vocab_size=config.vocab_size, steps=3, seed=0)
    batches = [data.to_device(data.collate("packed", [w.tokens(i) for i in b], args.budget), device)
               for b in w.bins[:3]]
    t0 = time.time()
    for b in batches[:2]:
        step(model, b)
    torch.cuda.synchronize()
    warm_s = time.time() - t0

    sites: collections.Counter = collections.Counter()
    messages: dict = {}
    total = 0

    def on_warning(message, category, filename, lineno, file=None, line=None):
        nonlocal total
        if "called a synchronizing" not in str(message):  # not the "prototype feature" notice
            return
        total += 1
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in KEEP)]
        site = " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                           for f in reversed(frames[-6:]))
        sites[site] += 1
        messages.setdefault(site, str(message)[:200])

    old = warnings.showwarning
    warnings.showwarning = on_warning
    warnings.simplefilter("always")
    torch.cuda.synchronize()
    t0 = time.time()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        loss = step(model, batches[2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    torch.cuda.synchronize()
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "versions": report.versions, "model": args.model, "layers": args.layers, "gc": args.gc,
        "experts": report.to_dict()["experts"], "warmup_s": round(warm_s, 1),
        "traced_step_s": round(time.time() - t0, 3), "loss": loss, "syncs": total,
        "sites": [{"count": n, "site": s, "message": messages[s]} for s, n in sites.most_common()],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "sites"}, indent=1))
    for s in result["sites"][:15]:
        print(f"{s['count']:5d}  {s['site']}")


if __name__ == "__main__":
    main()
