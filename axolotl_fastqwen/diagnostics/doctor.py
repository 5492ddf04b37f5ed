"""`python -m axolotl_fastqwen doctor`: what will run here, and what is known to go wrong.

Prints versions, the backend each fused op would use and why the faster ones were not chosen,
the kernel self-check at the chosen model's shapes (GPU only), what stock transformers resolved,
and known-bad combinations. On a CPU-only machine it says what would happen on a GPU instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import logging
import sys

import torch

from .. import registry
from ..devices import from_arg
from ..layers.experts_implementation import registered_implementations
from ..kernel_choice import CheckShapes, hopper_guard, select_kernels, selfcheck
from ..ops import availability
from ..transformers_functions import resolved_kernel
from .model_shapes import DEFAULT_SHAPE, SHAPES, build_config, get_shape



def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="axolotl-fastqwen doctor", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_SHAPE, choices=sorted(SHAPES), help="shapes for the self-check")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", default=None, help="also write the findings to this JSON file")
    return p


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def _experts_backends(device: torch.device) -> dict[str, str]:
    """The experts implementations transformers can dispatch to here, and what each needs."""
    names = registered_implementations()
    if names is None:
        return {"transformers": "no ExpertsInterface in this transformers (transformers.integrations.moe)"}
    out = {"registered": ", ".join(names)}
    grouped = hasattr(torch, "_grouped_mm")
    out["grouped_mm"] = ("torch._grouped_mm present" if grouped else "torch._grouped_mm missing") + (
        " (bf16 grouped GEMM on sm_90+; transformers' default)" if device.type == "cuda" else "")
    out["fastqwen_grouped"] = ("the plugin's: transformers' grouped_mm math without the expert-parallel masking, "
                               "peft's expert LoRA factored; replaces grouped_mm when a model would run it")
    scatter = _import_error("axolotl.integrations.kernels.libs.scattermoe_lora.experts")
    out["scattermoe"] = ("Axolotl's ScatterMoE importable (registered when its KernelsPlugin has use_scattermoe: "
                         "true)" if scatter is None else f"not importable ({scatter[:120]})")
    return out


def _experts_selfcheck(shape, device: torch.device) -> dict[str, str]:
    """MoE shapes: the experts self-check of the first GPU forward, run now on one experts module at
    the shape (what the plugin runs where transformers would run `grouped_mm`); a CPU says when
    it would run."""
    from ..kernel_choice.experts_selfcheck import selfcheck_experts
    from ..layers.grouped_experts import GROUPED, register
    from .model_shapes import build_experts

    if device.type != "cuda":
        return {"selfcheck": "runs on the first GPU forward of an MoE model (the load report gives its result)"}
    register()
    experts = build_experts(shape, device, torch.bfloat16, implementation=GROUPED)
    if experts is None:
        return {}
    print(f"\nexperts self-check at {shape.name} shapes ...", flush=True)
    try:
        check = selfcheck_experts(experts, torch.bfloat16)
    except Exception as exc:  # the doctor reports, it does not stop
        return {"selfcheck": f"raised {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        del experts
        torch.cuda.empty_cache()
    out = {"selfcheck": f"{check.implementation}: {check.selfcheck}"}
    if check.rejected:
        out["selfcheck_rejected"] = "; ".join(check.to_dict()["rejected"])
    return out


def _kernel_table(kernels) -> list[dict]:
    return [
        {"op": op, "backend": c.backend.name, "fallback": c.backend.fallback, "selfcheck": c.selfcheck,
         "rejected": [f"{n}: {why}" for n, why in c.rejected]}
        for op, c in kernels.choices.items()
    ]


def known_problems(device: torch.device, versions: dict) -> list[dict]:
    """(level, finding) pairs: 'bad' breaks or silently slows training, 'warn' may, 'ok' is reassurance."""
    out = []

    def add(level, topic, text):
        out.append({"level": level, "topic": topic, "text": text})

    # fla's Hopper guard against the installed Triton
    triton = versions.get("triton")
    if versions.get("fla"):
        lo, hi = hopper_guard.TRITON_AFFECTED
        in_range = hopper_guard.triton_affected()
        if hopper_guard.active():
            add("warn", "fla Hopper guard",
                f"active here (Hopper GPU, Triton {triton}): fla raises in its gated GDN backward (fla#640). "
                "The plugin's self-check runs the kernel at the model's head dims with the guard lifted and "
                "uses it only if it matches the fp32 reference; stock transformers + fla would crash in backward.")
        elif in_range:
            add("warn", "fla Hopper guard",
                f"Triton {triton} is in fla's refused range [{lo}, {hi}): on "
                "a Hopper GPU (H100/H200) fla would raise in its gated GDN backward (fla#640); the plugin's "
                "self-check decides by running it (head dim 128 measured correct on an H200 with Triton 3.6).")
        else:
            add("ok", "fla Hopper guard", f"not triggered by Triton {triton}")
    # fla installed but not importable (e.g. Triton 3.9 + fla 0.5.2)
    fla_dist = _dist_version("fla-core") or _dist_version("flash-linear-attention")
    if fla_dist and not versions.get("fla"):
        add("bad", "fla", f"fla {fla_dist} is installed but does not import: {_import_error('fla')} "
            "(a Triton it does not support? fla 0.5.2 fails with Triton 3.9: pin triton<3.9)")
    # transformers resolves fla even without a GPU
    for family in registry.families():
        module = family.modeling_module
        with contextlib.suppress(Exception):
            chosen = resolved_kernel(module, "torch_chunk_gated_delta_rule", device.type)
            if chosen != "torch" and device.type != "cuda":
                add("bad", "transformers on CPU",
                    f"{module} resolved its gated delta rule to {chosen} at import although there is no GPU: the "
                    "stock forward crashes here ('0 active drivers'). The plugin's layers route around it; "
                    "stock baselines need axolotl_fastqwen.transformers_functions.stock_torch_kernels().")
                break
    # causal-conv1d without its CUDA extension
    cc_dist = _dist_version("causal-conv1d")
    if cc_dist and not availability.has_causal_conv1d():
        add("bad", "causal-conv1d",
            f"causal-conv1d {cc_dist} is installed without a working CUDA extension "
            f"({_import_error('causal_conv1d_cuda') or _import_error('causal_conv1d')}): the conv falls back to "
            "fla's Triton conv (plugin) or to the torch conv that ignores seq_idx (stock: leaks across packed "
            "sequences). Rebuild it on the GPU machine for sm_90 only.")
    elif not cc_dist:
        add("warn", "causal-conv1d", "not installed: the plugin uses fla's Triton conv (boundary-exact via "
            "cu_seqlens); stock transformers uses a torch conv that ignores packed boundaries")
    else:
        add("ok", "causal-conv1d", f"{cc_dist} with its CUDA extension")
    # varlen attention
    varlen_error = _import_error("torch.nn.attention.varlen")
    if varlen_error:
        add("warn", "varlen attention",
            f"torch {torch.__version__} has no torch.nn.attention.varlen ({varlen_error[:120]}); without "
            "flash-attn the plugin's packed attention runs per-sequence SDPA (correct, slower)")
    elif not availability.has_flash_attn():
        add("ok", "varlen attention", "torch.nn.attention.varlen importable (used on CUDA; no flash-attn needed)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    device = from_arg(args.device)
    versions = availability.versions()
    versions["driver"] = availability.driver_version()
    versions["python"] = sys.version.split()[0]
    findings: dict = {"device": str(device), "versions": versions}
    print("axolotl_fastqwen doctor", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    shape = get_shape(args.model)
    config = build_config(shape, layers=4)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = CheckShapes(
        key_heads=config.linear_num_key_heads, value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim, value_dim=config.linear_value_head_dim,
        conv_width=config.linear_conv_kernel_dim, q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype, hidden=config.hidden_size,
        intermediate=getattr(config, "shared_expert_intermediate_size", None) or config.intermediate_size,
    )
    kernels = select_kernels(device, "auto")
    if device.type == "cuda":
        print(f"\nself-check at {args.model} head shapes ({shapes}) ...", flush=True)
        try:
            selfcheck(kernels, shapes)
        except Exception as exc:
            findings["selfcheck_error"] = f"{type(exc).__name__}: {exc}"
            print(f"self-check raised: {findings['selfcheck_error']}", flush=True)
        findings["kernels"] = _kernel_table(kernels)
        title = f"kernels on {device} (self-checked at {args.model} shapes)"
    else:
        findings["kernels_here"] = _kernel_table(kernels)
        quiet = logging.getLogger("axolotl_fastqwen")
        level, quiet.level = quiet.level, logging.ERROR  # its SLOW PATH warning is about this hypothetical set
        try:
            gpu = select_kernels("cuda", "auto")  # availability only; nothing touches CUDA
        finally:
            quiet.setLevel(level)
        findings["kernels"] = _kernel_table(gpu)
        for row in findings["kernels"]:
            if row["op"] == "varlen_attention" and row["fallback"] and not _import_error("torch.nn.attention.varlen"):
                row["backend"] = "torch-varlen"
                row["fallback"] = False
                row["rejected"] = [r for r in row["rejected"] if not r.startswith("torch-varlen")]
                row["selfcheck"] = "torch.nn.attention.varlen imports; chosen when torch.cuda is available"
        title = ("no GPU here: kernels a CUDA device WOULD get with these packages (self-check runs only on a GPU; "
                 "torch varlen attention additionally needs torch.cuda at run time)")
    print(f"\n{title}:", flush=True)
    print(f"  {'op':<22} {'backend':<14} why / self-check", flush=True)
    for row in findings["kernels"]:
        why = row["selfcheck"] or ""
        if row["rejected"]:
            why = (why + "; " if why else "") + "not: " + "; ".join(row["rejected"])
        print(f"  {row['op']:<22} {row['backend']:<14} {why}", flush=True)

    findings["stock_resolution"] = {}
    for family in registry.families():
        with contextlib.suppress(Exception):
            findings["stock_resolution"][family.name] = {
                name: resolved_kernel(family.modeling_module, name)
                for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
            }
    print("\nstock transformers resolved (at import): " + "; ".join(
        f"{fam}: {res}" for fam, res in findings["stock_resolution"].items()), flush=True)

    findings["experts"] = _experts_backends(device)
    findings["experts"].update(_experts_selfcheck(shape, device))
    print("\nrouted experts (MoE models; the plugin's fastqwen_grouped where transformers would run grouped_mm, "
          "else what the user or an integration chose; the load report names the one a model uses): " + "; ".join(f"{k}: {v}" for k, v in findings["experts"].items()),
          flush=True)

    findings["problems"] = known_problems(device, versions)
    print("\nknown-bad combinations:", flush=True)
    for p in findings["problems"]:
        print(f"  [{p['level']:>4}] {p['topic']}: {p['text']}", flush=True)
    bad = sum(p["level"] == "bad" for p in findings["problems"])
    print(f"\n{bad} problem(s), {sum(p['level'] == 'warn' for p in findings['problems'])} warning(s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(findings, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
