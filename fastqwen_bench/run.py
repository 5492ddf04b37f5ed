"""`python -m fastqwen_bench bench`: every training path, one model, one token stream, one process.

The model is built once (random weights, on the device); before each path the trainable weights
are reset to the same seeded values and a fresh AdamW is made, so every path starts from the same
state. Each path: calibration loss on the shared first row -> warm-up steps -> one profiled step
(launches, GPU time) -> timed steps. A path that errors or runs out of memory is recorded and the
run continues; bench.json is rewritten after every path, so a killed run still leaves its results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from axolotl_fastqwen.memory.checkpoint_fitter import DEFAULT_CHECKPOINTING_MEMORY, FIT_STEPS, CheckpointFitter, memory_of
from axolotl_fastqwen.patching.moe_cuda_graphs import DEFERRED
from fastqwen_bench import data, host_profile, measure
from fastqwen_bench.measure import TRITON
from fastqwen_bench.quantized_base import quantize_base
from fastqwen_bench.paths import (CHECKPOINTING_AUTO, LETTERS, PATHS, QUANTIZED, REFERENCE_PATHS, PathSkipped, installed,
                                  parse_paths)
from fastqwen_bench.shapes import BENCH_SHAPES, DEFAULT_SHAPE, build_config, build_model, get_shape, init_weights_, linear_params
from fastqwen_bench.shapes import lora_target_parameters, lora_targets, matmul_params_per_token

SCHEMA = "fastqwen_bench/1"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def log(*parts) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------------------------
# Arguments (shared with `profile`)
# --------------------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_SHAPE, choices=sorted(BENCH_SHAPES), help="named model shape")
    p.add_argument("--layers", type=int, default=None, help="cut depth to N layers (3 GDN : 1 attention kept)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="full", action="store_false", help="LoRA r=16 alpha=32 (default)")
    mode.add_argument("--full", dest="full", action="store_true", help="full fine-tune (AdamW on every weight)")
    p.set_defaults(full=False)
    p.add_argument("--gc", action="store_true", help="gradient checkpointing (non-reentrant)")
    p.add_argument("--qlora", action="store_true",
                   help="the base quantized as Axolotl's QLoRA MoE examples load it (load_in_4bit: every decoder "
                        "linear a bitsandbytes Linear4bit; quantize_moe_experts: the expert stacks in 4 bits) before "
                        "the adapters; every path trains it (axolotl-best with adapter: qlora). LoRA only")
    p.add_argument("--lora-experts", action="store_true",
                   help="MoE shapes: also LoRA on the routed experts' 3D weights (peft target_parameters "
                   "mlp.experts.gate_up_proj / down_proj)")
    p.add_argument("--budget", type=int, default=8192, help="tokens per packed row (multiple of 64)")
    p.add_argument(
        "--micro-batch-size", type=int, default=None,
        help="sequences per padded batch (default: mean sequences per packed row, so a padded step holds "
        "about as many real tokens as a packed one)",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per path")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per path before profiling/timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--median-length", type=float, default=500.0, help="median sequence length of the sft stream")
    p.add_argument("--stream", default="sft", choices=data.STREAMS,
                   help="sft: short sequences (lognormal, <= 2048) packed long; long: sequences log-uniform from "
                   "min(8192, budget/4) to the row; single: one sequence filling each row (long-context rows)")
    p.add_argument(
        "--autocast", default="auto", choices=("auto", "on", "off"),
        help="run forwards under torch.autocast(bf16), as HF Trainer / Accelerate do for `bf16: true` "
        "(auto: on for a bf16 model on CUDA). Off runs peft's fp32 LoRA adapters as fp32 GEMMs",
    )
    p.add_argument("--allocator", default="axolotl", choices=("axolotl", "default"),
                   help="the CUDA caching allocator: as `axolotl train` sets it (expandable_segments:True, unless "
                   "PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF is set) or torch's default")
    p.add_argument("--checkpointing-memory", type=float, default=DEFAULT_CHECKPOINTING_MEMORY,
                   help="fastqwen_checkpointing_memory of the ckpt-auto paths (fraction of the GPU's memory)")
    p.add_argument("--keep-fla-guard", action="store_true",
                   help="do not lift fla's Hopper guard (fla#640) even when its GDN passes the self-check")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastqwen_bench bench", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--paths", default="all",
                   help="comma list of path names or letters: " + ", ".join(f"{k}={v}" for k, v in LETTERS.items())
                   + "; default all (MoE-only paths skip themselves on dense shapes)")
    p.add_argument("--out", default="outputs/fastqwen-bench", help="output folder (bench.json, bench.md, bench.png)")
    p.add_argument("--max-path-seconds", type=float, default=150.0,
                   help="stop a path's warm-up / timed steps after this long (>= 1 timed step); recorded as truncated")
    p.add_argument("--max-total-seconds", type=float, default=None,
                   help="wall-clock budget of the whole run from its start: each path gets at most an equal share "
                   "of what is left (and --max-path-seconds); a path that cannot start in time is skipped and "
                   "recorded. Set it under the machine's per-command limit so the run ends on its own")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="after each path's timed steps, run STEPS more on the same rows under pyinstrument: the "
                        "host's time by package and function (host_<path>.txt; bench.json `host_profile`)")
    p.add_argument("--no-oom-retry", dest="oom_retry", action="store_false",
                   help="padded paths: do not retry with half the micro batch after an out-of-memory")
    return p


# --------------------------------------------------------------------------------------------
# The shared model and stream
# --------------------------------------------------------------------------------------------


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    family: str
    config: object
    model: torch.nn.Module
    trainable: list
    workload: data.Workload
    micro_batch_size: int
    matmul: dict
    lora_params: int
    peak: dict
    autocast: bool = False
    info: dict = field(default_factory=dict)

    def amp(self):
        """The forward's precision context: Accelerate wraps `model.forward` in autocast when the
        Trainer runs with `bf16: true` (and leaves backward outside it); so do we."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def reset(self) -> None:
        """Trainable weights back to their seeded start (LoRA: A random, B = 0; full: all weights)."""
        for p in self.trainable:
            p.grad = None
        init_weights_(self.model, self.args.seed, std=self.config.initializer_range, only_trainable=True)

    def optimizer(self) -> torch.optim.Optimizer:
        fused = {"fused": True} if self.device.type == "cuda" else {}
        return torch.optim.AdamW(self.trainable, lr=self.args.lr, **fused)


def resolve_device(args) -> tuple[torch.device, torch.dtype]:
    from axolotl_fastqwen.devices import from_arg

    device = from_arg(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype or "")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def prepare(args, steps_per_path: int) -> Setup:
    """Peak matmul, model build (+ LoRA, gradient checkpointing), token stream."""
    allocator = measure.configure_allocator(args.allocator)  # before the first CUDA allocation
    device, dtype = resolve_device(args)
    autocast = use_autocast(args, device, dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    TRITON.install()
    log(f"[setup] device {device}, dtype {str(dtype).replace('torch.', '')}; measuring peak matmul ...")
    peak = measure.peak_matmul_tflops(device)
    log(f"[setup] peak: {peak['tflops']} TFLOP/s ({peak['method']})")

    shape = get_shape(args.model)
    config = build_config(shape, args.layers)
    model, build_s = build_model(config, shape.family, device, dtype, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[setup] built {args.model} x{config.num_hidden_layers} layers ({n_params / 1e9:.2f} B params) "
        f"on {device} in {build_s:.1f} s")
    guard = fla_guard_decision(args, config, device, dtype)
    dense_linear = linear_params(model)
    qlora = None
    if getattr(args, "qlora", False):
        qlora = quantize_base(model, dtype)
        log(f"[setup] QLoRA base (load_in_4bit + quantize_moe_experts): {qlora}")
    lora_params = 0
    target_parameters = [] if args.full else lora_target_parameters(shape.family, args.lora_experts)
    if args.full:
        trainable = [p for p in model.parameters()]
    else:
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        if qlora is not None and qlora["expert_stacks"]:
            # peft alone mistakes a 4-bit stack's parametrization for a module named like a target and does not find
            # the stacks for target_parameters: Axolotl's loader applies this whenever quantize_moe_experts is set
            from axolotl.monkeypatch.moe_quant import patch_peft_target_parameters_matching

            patch_peft_target_parameters_matching()
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=lora_targets(shape.family),
                          target_parameters=target_parameters or None)
        model = get_peft_model(model, lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        lora_params = sum(p.numel() for p in trainable)
    if args.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    matmul = matmul_params_per_token(config)

    steps = steps_per_path
    workload = data.make_workload(
        budget=args.budget, vocab_size=config.vocab_size, steps=steps, seed=args.seed,
        median=args.median_length, micro_batch_size=args.micro_batch_size, stream=args.stream,
    )
    mbs = args.micro_batch_size or workload.default_micro_batch_size(steps)
    info = {
        "shape": args.model,
        "family": shape.family,
        "description": shape.description,
        "layers": config.num_hidden_layers,
        "gated_deltanet_layers": list(config.layer_types).count("linear_attention"),
        "attention_layers": list(config.layer_types).count("full_attention"),
        "params_total": n_params,
        "params_trainable": sum(p.numel() for p in trainable),
        "matmul_params_per_token": matmul,
        "linear_params_scanned": dense_linear,
        "build_seconds": round(build_s, 2),
        "dtype": str(dtype).replace("torch.", ""),
        "finetune": "full" if args.full else "lora",
        "lora": None if args.full else {"r": 16, "alpha": 32, "targets": lora_targets(shape.family),
                                        "target_parameters": target_parameters},
        "gradient_checkpointing": bool(args.gc),
        "qlora": qlora,
        "attn_implementation": config._attn_implementation,
        "fla_hopper_guard": guard,
        "autocast": autocast,
        "allocator": {**allocator, "expandable_segments": measure.expandable_segments(device)},
    }
    experts = getattr(config, "num_experts", 0) or 0
    if experts:
        from axolotl_fastqwen.families.base import unwrap

        info["experts_implementation_at_build"] = unwrap(model).config._experts_implementation
    return Setup(args, device, dtype, shape.family, config, model, trainable, workload, mbs, matmul, lora_params,
                 peak, autocast, info)


def use_autocast(args, device: torch.device, dtype: torch.dtype) -> bool:
    if args.autocast == "auto":
        return device.type == "cuda" and dtype == torch.bfloat16
    if args.autocast == "on" and dtype != torch.bfloat16:
        raise SystemExit("--autocast on needs --dtype bf16 (autocast runs the forward in the model's dtype)")
    return args.autocast == "on"


def check_shapes(config, dtype: torch.dtype):
    from axolotl_fastqwen.kernel_choice import CheckShapes

    return CheckShapes(
        key_heads=config.linear_num_key_heads, value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim, value_dim=config.linear_value_head_dim,
        conv_width=config.linear_conv_kernel_dim, q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype, hidden=config.hidden_size,
    )


def fla_guard_decision(args, config, device: torch.device, dtype: torch.dtype) -> str:
    """fla refuses its gated GDN backward on Hopper with some Triton releases (fla#640,
    kernels/hopper_guard.py), which would fail every fla path at its first backward. Decide once,
    for all paths alike, the way the plugin does: run the plugin's GPU self-check at this model's
    head dims; if fla's GDN passes with the guard lifted, the guard stays lifted for the whole run
    (its owner, this decision's kernel set, never releases it)."""
    from axolotl_fastqwen.kernel_choice import hopper_guard, select_kernels, selfcheck
    from axolotl_fastqwen.ops.availability import version_of

    if device.type != "cuda" or not hopper_guard.active():
        return "not active"
    if args.keep_fla_guard:
        return "active, kept (--keep-fla-guard): fla's gated GDN backward raises, so fla paths are expected to fail"
    try:
        kernels = select_kernels(device, "auto")
        with torch.enable_grad():
            selfcheck(kernels, check_shapes(config, dtype))
    except Exception as exc:  # the decision must not abort the benchmark
        verdict = f"kept: the self-check raised {type(exc).__name__}: {str(exc)[:300]}"
        log(f"[setup] fla Hopper guard: {verdict}")
        return verdict
    choice = kernels.choices["gated_delta_rule"]
    dims = f"K={config.linear_key_head_dim}, V={config.linear_value_head_dim}"
    if not hopper_guard.active():
        verdict = f"lifted for all paths: fla's GDN passed the self-check at {dims} ({choice.selfcheck})"
    elif choice.backend.name == "fla":
        # fla 0.6 runs the guarded backward piece (chunk_bwd_dqkwg) on its TileLang backend on Hopper
        # when tilelang is installed, so the guard is never reached
        verdict = (f"not needed: fla's GDN passed the self-check at {dims} with the guard in place "
                   f"({choice.selfcheck}; tilelang {version_of('tilelang')})")
    else:
        verdict = f"kept: fla's GDN did not pass the self-check ({'; '.join(w for _, w in choice.rejected)[:300]})"
    log(f"[setup] fla Hopper guard (fla#640, Triton {version_of('triton')}): {verdict}")
    return verdict


# --------------------------------------------------------------------------------------------
# One path
# --------------------------------------------------------------------------------------------


def train_step(model, optimizer, batch: dict, amp=contextlib.nullcontext) -> torch.Tensor:
    with amp():
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def calibration_loss(model, batches: list[dict], device: torch.device, amp=contextlib.nullcontext) -> float:
    """Mean per-token loss over all batches (each normalised by the total target count)."""
    n = sum(data.targets(b) for b in batches)
    total = 0.0
    for b in batches:
        with amp():
            total += float(model(**data.to_device(b, device), num_items_in_batch=n).loss)
    return total


def build_batches(setup: Setup, layout: str, n: int, mbs: int) -> tuple[list[dict], list[list[int]], list[dict]]:
    w = setup.workload
    steps = w.steps(layout, n, mbs)
    seqs = [[w.tokens(i) for i in ids] for ids in steps]
    batches = [data.collate(layout, s, w.budget) for s in seqs]
    lengths = [[len(x) for x in s] for s in seqs]
    calib = [data.collate(layout, [w.tokens(i) for i in ids], w.budget, calibration=True)
             for ids in w.calibration(layout, mbs)]
    return batches, lengths, calib


def measure_path(setup: Setup, name: str, mbs: int, record: dict, started: float, limit: float,
                 progress=lambda: None) -> None:
    """One path: calibration, warm-up, a profiled step, timed steps; `limit` seconds from `started`
    cut the warm-up and the timed steps (>= 1 timed step); `progress()` is called after each
    stage so a killed run leaves a partial record."""
    args, device, model = setup.args, setup.device, setup.model
    spec = PATHS[name]
    fit = name in CHECKPOINTING_AUTO and args.gc
    n_common = args.warmup + 1 + args.steps
    n_total = n_common + (FIT_STEPS if fit else 0)
    # every path profiles row `warmup` and times the rows after it; a fitting path first runs its
    # fitting steps on rows past those (so its timed rows are every other path's)
    warm_rows = list(range(n_common, n_total)) + list(range(args.warmup))
    warmup = len(warm_rows)
    record["notes"] = []  # a retry starts over
    setup.reset()
    optimizer = setup.optimizer()
    measure.free_memory(device)
    counters0 = (TRITON.snapshot(), measure.dynamo_snapshot())
    with installed(name, model, setup.family, device, setup.dtype, bool(args.gc), args.budget) as info, \
            contextlib.ExitStack() as undo:
        record["notes"] += info["notes"]
        for key in ("stock_kernels", "axolotl_components", "axolotl_config", "axolotl_fp8"):
            if key in info:
                record[key] = info[key]
        if "experts_implementation_at_build" in setup.info:
            from axolotl_fastqwen.families.base import unwrap

            record["experts_implementation"] = unwrap(model).config._experts_implementation
        record["setup_seconds"] = round(time.perf_counter() - started, 2)
        batches, lengths, calib = build_batches(setup, spec.layout, n_total, mbs)
        if spec.layout == "multipack":
            first = setup.workload.tokens(setup.workload.bins[0][0])
            record["collator"] = data.multipack_batch([first], args.budget)[1]
        record["micro_batch_size"] = mbs if spec.layout == "padded" else None
        t = time.perf_counter()
        record["calibration_loss"] = calibration_loss(model, calib, device, setup.amp)
        record["calibration_targets"] = sum(data.targets(b) for b in calib)
        record["calibration_seconds"] = round(time.perf_counter() - t, 2)
        log(f"[{name}] calibration loss {record['calibration_loss']:.6f} over {record['calibration_targets']} "
            f"targets ({record['calibration_seconds']} s)")
        progress()

        fitter = None
        if fit:
            fitter = CheckpointFitter(model, memory_of(device), fraction=args.checkpointing_memory)
            undo.callback(fitter.restore)  # an error or OOM mid-path must not leave layers un-checkpointed

        def step(k: int, optimizer=optimizer) -> torch.Tensor:
            if fitter is not None:
                fitter.step_begin()
            with info.get("step_context", contextlib.nullcontext)():
                loss = train_step(model, optimizer, data.to_device(batches[k], device), setup.amp)
            if fitter is not None:
                fitter.step_end()
                record["checkpointing"] = fitter.to_dict()
            return loss

        losses, warm, ran = [], [], []
        for i, row in enumerate(warm_rows):
            if row > n_common and fitter is not None and fitter.phase in ("settled", "off"):
                continue  # settled early: the fitting rows left would only repeat a warm-up (a minute a step at 128k)
            seconds, loss = _timed(lambda row=row: step(row), device)
            warm.append(seconds)
            ran.append(row)
            losses.append(loss)
            log(f"[{name}] warm-up {i + 1}/{warmup}: {seconds:.2f} s, loss {loss:.4f}"
                + (f"; checkpointing: {fitter.summary()}" if fitter is not None else ""))
            record["warmup_seconds"] = [round(x, 3) for x in warm]
            progress()
            if time.perf_counter() - started > limit and i + 1 < warmup:
                record["notes"].append(f"warm-up cut to {i + 1} steps (path budget {limit:.0f} s)")
                break
        if fitter is not None and fitter.phase not in ("settled", "off"):
            record["notes"].append(f"checkpointing not settled by the timed steps ({fitter.summary()})")
        graphs_before = _graphs_unsettled(info)
        counters1 = (TRITON.snapshot(), measure.dynamo_snapshot())
        memory = memory_of(device)  # allocator retries: a device-wide stall each (fragmentation)
        retries1 = memory.retries() if memory is not None else None
        compiled1 = len(TRITON.compiled)
        w = args.warmup  # the profiled row; the timed rows follow it (the same rows in every path)
        prof = measure.count_launches(lambda: step(w), device)
        losses.append(float(prof["result"]))
        record["launches"] = prof["launches"]
        if prof["launches"]["unit"] == "cuda_kernels" and not prof["launches"]["count"]:
            record["notes"].append("the profiler recorded no CUDA kernels (CUPTI unavailable?): launches unknown")
        log(f"[{name}] profiled step: {prof['launches']['count']} {prof['launches']['unit']}, "
            f"GPU kernel time {prof['launches']['gpu_kernel_ms']} ms")
        times, tokens, flops_model, flops_hw, slots, gc_pauses = [], [], 0.0, 0.0, [], []
        host_ms, sm_mhz = [], []  # per timed step: the host's time to issue it, the SM clock after it
        record["rows"] = {"warmup": ran, "profiled": w, "timed": []}
        for j in range(args.steps):
            k = w + 1 + j
            record["rows"]["timed"].append(k)
            seconds, loss = _timed(lambda k=k: step(k), device, gc_pauses, host_ms)
            sm_mhz.append(_sm_clock_mhz(device))
            times.append(seconds)
            losses.append(loss)
            tokens.append(sum(lengths[k]))
            slots.append(data.slots(batches[k]))
            recomputed = (fitter.recomputed_fraction() if fitter is not None else 1.0) if args.gc else 0.0
            f = measure.step_flops(lengths[k], setup.config, setup.matmul, full=args.full, gc=recomputed,
                                   lora_params=setup.lora_params)
            flops_model += f["model"]
            flops_hw += f["hardware"]
            log(f"[{name}] step {j + 1}/{args.steps}: {seconds:.3f} s, {tokens[-1]} tokens, loss {loss:.4f}")
            if time.perf_counter() - started > limit and j + 1 < args.steps:
                record["truncated"] = f"after {j + 1} timed steps (path budget {limit:.0f} s)"
                log(f"[{name}] {record['truncated']}")
                break
        counters2 = (TRITON.snapshot(), measure.dynamo_snapshot())
        graphs_after = _graphs_unsettled(info)
        if graphs_after is not None and graphs_after != graphs_before:
            record["notes"].append(
                f"moe cuda graphs not settled by the timed steps: {graphs_after[0] - graphs_before[0]} capture(s) and "
                f"{graphs_after[1] - graphs_before[1]} warm-up or deferred call(s) in the profiled and timed steps "
                "(raise --warmup)")
        retries2 = memory.retries() if memory is not None else None
        compiled_after = TRITON.compiled[compiled1:compiled1 + 20]
        if getattr(args, "host_profile", 0) and record["rows"]["timed"]:
            why = host_profile.available()
            if why is None:
                rows = (record["rows"]["timed"] * args.host_profile)[:args.host_profile]
                record["host_profile"] = host_profile.profile_steps(step, rows, getattr(args, "out", None), name)
                log(f"[{name}] {host_profile.describe(record['host_profile'])}")
            else:
                record["notes"].append(f"--host-profile: {why}")
    if "patch_report" in info:
        record["patch_report"] = info["patch_report"]
    if "stats" in info:
        record.update(info["stats"]())
    optimizer.zero_grad(set_to_none=True)
    del optimizer

    total_s = sum(times)
    peak_tflops = setup.peak["tflops"]
    dyn_after = measure.delta(counters2[1], counters1[1])
    launches = record["launches"]
    median = statistics.median(times)
    record.update(
        steps_measured=len(times),
        warmup_seconds=[round(s, 3) for s in warm],
        step_seconds=[round(s, 4) for s in times],
        gc_per_step=gc_pauses,  # Python's collections in each timed step: pause ms, collections per generation
        # what a spread of step times comes from: the host's time to issue each step (the step returned, before
        # the final device sync; near the step's time where the GPU waits on the host), the SM clock after it
        host_ms_per_step=host_ms, sm_clock_mhz_per_step=sm_mhz,
        step_time_median_s=round(median, 4),
        tokens_per_s=round(sum(tokens) / total_s, 1),
        real_tokens_per_step=round(sum(tokens) / len(tokens), 1),
        slots_per_step=round(sum(slots) / len(slots), 1),
        padding_fraction=round(1 - sum(tokens) / sum(slots), 4),
        step_losses=[round(x, 6) for x in losses],
        gpu_busy_fraction=(round(launches["gpu_kernel_ms"] / (median * 1000), 3)
                           if launches["gpu_kernel_ms"] is not None else None),
        model_tflops=round(flops_model / total_s / 1e12, 3),
        hardware_tflops=round(flops_hw / total_s / 1e12, 3),
        mfu=round(flops_model / total_s / 1e12 / peak_tflops, 4),
        hfu=round(flops_hw / total_s / 1e12 / peak_tflops, 4),
        peak_memory_gib=measure.peak_memory_gib(device),
        alloc_retries_after_warmup=retries2 - retries1 if retries1 is not None else None,
        dynamo_after_warmup=dyn_after,
        recompiles_after_warmup=measure.recompiles(dyn_after),
        triton_during_warmup=measure.delta(counters1[0], counters0[0]),
        triton_after_warmup=measure.delta(counters2[0], counters1[0]),
        triton_compiled_after_warmup=compiled_after,
    )


def _graphs_unsettled(info: dict) -> tuple[int, int] | None:
    """`fastqwen_moe_cuda_graphs`' captures so far and its block calls that ran eagerly only to warm up or for
    want of this forward's memory share: any of them in the timed steps means they timed the capture."""
    graphs = getattr(info.get("patch_report"), "moe_graphs", None)
    if graphs is None:
        return None
    return graphs.captures, graphs.eager["warm-up"] + graphs.eager[DEFERRED]


def _timed(fn, device, gc_pauses: list | None = None, host_ms: list | None = None) -> tuple[float, float]:
    """One step's wall time (device synchronised both ends) and loss; with `gc_pauses`, appends the
    step's garbage-collection pause (ms) and collections per generation; with `host_ms`, the ms until the step
    had been issued (before the final sync)."""
    measure.GC.install()
    measure.sync(device)
    before = measure.GC.snapshot()
    start = time.perf_counter()
    loss = fn()
    issued = time.perf_counter() - start
    measure.sync(device)
    seconds = time.perf_counter() - start
    if host_ms is not None:
        host_ms.append(round(issued * 1000, 2))
    if gc_pauses is not None:
        after = measure.GC.snapshot()
        gens = {g: n - before[1].get(g, 0) for g, n in after[1].items() if n - before[1].get(g, 0)}
        gc_pauses.append({"ms": round(after[0] - before[0], 2), "collections": gens})
    return seconds, float(loss)


def _sm_clock_mhz(device) -> int | None:
    """The GPU's SM clock over the last sample period (NVML, through torch); None on a CPU or without NVML."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable: the figure is optional
        return None


def run_path(setup: Setup, name: str, limit: float | None = None, record: dict | None = None,
             progress=lambda: None) -> dict:
    """Measure one path within `limit` seconds (default --max-path-seconds); never raises (errors,
    OOMs and skips are recorded). `record` (filled in place) lets the caller write it mid-path."""
    spec = PATHS[name]
    limit = setup.args.max_path_seconds if limit is None else limit
    record = {} if record is None else record
    record.update({"name": name, "layout": spec.layout, "summary": spec.summary, "status": "running", "notes": [],
                   "attempts": [], "budget_seconds": round(limit, 1)})
    mbs = setup.micro_batch_size if spec.layout == "padded" else 1
    started = time.perf_counter()
    log(f"\n===== {name}: {spec.summary} (budget {limit:.0f} s)")
    while True:
        try:
            measure_path(setup, name, mbs, record, started, limit, progress)
            record["status"] = "ok"
            break
        except PathSkipped as exc:
            record.update(status="skipped", error=str(exc))
            log(f"[{name}] skipped: {exc}")
            break
        except Exception as exc:  # recorded; the run goes on
            oom = measure.is_oom(exc)
            message = f"{type(exc).__name__}: {str(exc)[:1500]}"
            record["attempts"].append({"micro_batch_size": mbs if spec.layout == "padded" else None,
                                       "error": message, "oom": oom})
            tail = traceback.format_exc()[-3000:]
            del exc
            for p in setup.trainable:
                p.grad = None
            measure.free_memory(setup.device)
            log(f"[{name}] {'OUT OF MEMORY' if oom else 'ERROR'}: {message[:500]}")
            if oom and spec.layout == "padded" and setup.args.oom_retry and mbs > 1 \
                    and time.perf_counter() - started < limit:
                mbs //= 2
                log(f"[{name}] retrying with micro batch size {mbs}")
                continue
            record.update(status="oom" if oom else "error", error=message, traceback=tail)
            break
    for key in ("launches",):
        record.setdefault(key, None)
    record["seconds"] = round(time.perf_counter() - started, 1)
    for p in setup.trainable:
        p.grad = None
    measure.free_memory(setup.device)
    # the model, its LoRA and optimizer-free state: a later path's peak starts here (a path that ran out
    # of memory and left more behind would show it, 2026-12-06e)
    record["allocated_after_gib"] = measure.allocated_gib(setup.device)
    if record["status"] == "oom":
        record["notes"].append(f"after its cleanup {record['allocated_after_gib']} GiB stay allocated for the paths "
                               "after it (the model's own memory, or what the failure left)")
    return record


MIN_PATH_SECONDS = 20.0  # a path given less than this by --max-total-seconds is skipped, not started


def path_budget(args, elapsed: float, paths_left: int) -> float | None:
    """Seconds for the next path: --max-path-seconds, or under --max-total-seconds an equal share of
    what is left (paths that finish early leave more to the later ones). None: no budget at all."""
    if args.max_total_seconds is None:
        return args.max_path_seconds
    left = args.max_total_seconds - elapsed
    return min(args.max_path_seconds, left / max(1, paths_left))


def budget_skip(name: str, limit: float) -> dict:
    spec = PATHS[name]
    return {"name": name, "layout": spec.layout, "summary": spec.summary, "status": "skipped",
            "error": f"not started: {max(limit, 0):.0f} s of --max-total-seconds left for it (< {MIN_PATH_SECONDS:g} s)",
            "notes": [], "attempts": [], "launches": None}


def reference_ratios(records: list[dict]) -> dict:
    """Every path's tokens/s as a ratio to the faster axolotl-best variant of the same run."""
    ok = [r for r in records if r["name"] in REFERENCE_PATHS and r.get("status") == "ok" and r.get("tokens_per_s")]
    if not ok:
        return {"path": None, "tokens_per_s": None,
                "note": "no axolotl-best variant ran to completion: no ratios (run path f and/or g)"}
    ref = max(ok, key=lambda r: r["tokens_per_s"])
    for r in records:
        if r.get("tokens_per_s"):
            r["x_axolotl_best"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
    return {"path": ref["name"], "tokens_per_s": ref["tokens_per_s"],
            "rule": "the faster of axolotl-best / axolotl-best-cce in this run (same process, model and stream)"}


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def compare_calibration(records: list[dict], dtype: torch.dtype) -> dict:
    """Every path's calibration loss against the reference path's (stock torch if it ran); the FP8
    paths' (`QUANTIZED`) are reported beside, outside the agreement."""
    have = {r["name"]: r["calibration_loss"] for r in records if r.get("calibration_loss") is not None}
    tol = TOLERANCE.get(dtype, 1e-2)
    if not have:
        return {"reference": None, "max_rel_diff": None, "tolerance": tol, "agree": None}
    ref_name = next((n for n in ("stock-torch-padded", "fastqwen") if n in have), next(iter(have)))
    ref = have[ref_name]
    for r in records:
        if r["name"] in have:
            r["calibration_rel_diff"] = abs(have[r["name"]] - ref) / max(abs(ref), 1e-12)
    worst = max((r.get("calibration_rel_diff", 0.0) for r in records if r["name"] not in QUANTIZED), default=0.0)
    quantized = {r["name"]: r["calibration_rel_diff"] for r in records if r["name"] in QUANTIZED and
                 "calibration_rel_diff" in r}
    return {"reference": ref_name, "max_rel_diff": worst, "tolerance": tol, "agree": worst <= tol,
            "paths": sorted(have), "fp8_rel_diff": quantized}


def _fmt(value, spec: str = "", none: str = "-") -> str:
    if value is None:
        return none
    return format(value, spec)


def markdown(result: dict) -> str:
    m, wl = result["model"], result["workload"]
    lines = [
        f"# fastqwen_bench: {m['shape']} x{m['layers']} layers, {m['finetune']}"
        f"{' + gradient checkpointing' if m['gradient_checkpointing'] else ''}, {m['dtype']}"
        f"{' under autocast' if m.get('autocast') else ''}"
        f"{' (PARTIAL: run in progress or killed)' if result.get('partial') else ''}",
        "",
        f"{result['versions'].get('gpu') or result['device']}; torch {result['versions'].get('torch')}, "
        f"Triton {result['versions'].get('triton')}, transformers {result['versions'].get('transformers')}, "
        f"fla {result['versions'].get('fla')}, causal-conv1d {result['versions'].get('causal_conv1d')}; "
        f"peak {result['peak']['tflops']} TFLOP/s ({result['peak']['method']}); fla Hopper guard: "
        f"{m.get('fla_hopper_guard')}.",
        f"Stream: {wl['length_distribution']}; packed rows of {wl['budget']} tokens; padded batches of "
        f"{wl['micro_batch_size']} sequences ({wl['micro_batch_size_rule']}).",
        "",
        "| path | layout | status | tokens/s | x axolotl-best | step ms (median) | launches / step | GPU busy "
        "| MFU (HFU) | peak GiB | calib. loss (rel. diff) | after warm-up: recompiles / autotunes / compiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["paths"]:
        launches = r.get("launches") or {}
        count = launches.get("count")
        unit = "" if launches.get("unit") == "cuda_kernels" else " cpu ops"
        tri = r.get("triton_after_warmup") or {}
        status = r["status"] + (f" (mbs {r['micro_batch_size']})" if r.get("micro_batch_size") else "")
        if r.get("truncated"):
            status += ", truncated"
        calib = (f"{r['calibration_loss']:.5f} ({r.get('calibration_rel_diff', 0):.1e})"
                 if r.get("calibration_loss") is not None else "-")
        busy = (f"{launches['gpu_kernel_ms']:.0f} / {r['step_time_median_s'] * 1000:.0f} ms "
                f"({r['gpu_busy_fraction']:.0%})" if r.get("gpu_busy_fraction") is not None else "-")
        after = (f"{r.get('recompiles_after_warmup', 0)} / {tri.get('autotune_new_keys', 0)} / "
                 f"{tri.get('jit_compiles', 0)}" if r["status"] == "ok" else "-")
        mfu = f"{r['mfu']:.1%} ({r['hfu']:.1%})" if r.get("mfu") is not None else "-"
        lines.append(
            f"| {r['name']} | {r['layout']} | {status} | {_fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {_fmt(r.get('x_axolotl_best'), '.2f')} "
            f"| {_fmt(r.get('step_time_median_s') and r['step_time_median_s'] * 1000, ',.1f')} "
            f"| {_fmt(count, ',')}{unit if count is not None else ''} | {busy} | {mfu} "
            f"| {_fmt(r.get('peak_memory_gib'), '.1f')} | {calib} | {after} |"
        )
    cal = result["calibration"]
    lines += [
        "",
        f"Calibration: every path's loss on the same first packed row's {wl['calibration_sequences']} sequences "
        f"(padded paths: in micro-batches), reference {cal['reference']}: max rel. diff "
        f"{_fmt(cal['max_rel_diff'], '.2e')} (tolerance {cal['tolerance']:.0e}: "
        f"{'agree' if cal['agree'] else 'DISAGREE' if cal['agree'] is False else 'n/a'}).",
        "",
        f"MFU: {result['flops']['formula']}",
    ]
    ref = result.get("reference") or {}
    if ref:
        lines += ["", f"Speed reference: {ref.get('path') or '-'} ({ref.get('rule') or ref.get('note')})."]
    for r in result["paths"]:
        comps = r.get("axolotl_components")
        if not comps:
            continue
        lines += ["", f"{r['name']}: Axolotl components", "", "| component | status | how / why |", "|---|---|---|"]
        for c in comps:
            why = "; ".join(c["effect"]) if c["status"] == "applied" else c["reason"]
            lines.append(f"| {c['key']} | {c['status']} | `{c['function']}`: {why.replace('|', '/')} |")
    for r in result["paths"]:
        if r.get("checkpointing"):
            steps = "; ".join(f"after step {d['step']}: keep {d['kept_layers']} ({d['why']}, peak {d['peak_gib']} GiB)"
                              for d in r["checkpointing"]["decisions"])
            lines += ["", f"{r['name']}: fastqwen_checkpointing: auto: {r['checkpointing']['summary']}; steps: {steps}"]
    for r in result["paths"]:
        if r.get("host_profile"):
            lines += ["", f"{r['name']}: {host_profile.describe(r['host_profile'])}"]
    for r in result["paths"]:
        pauses = r.get("gc_per_step")
        if pauses:
            ms = [p["ms"] for p in pauses]
            lines += ["", f"{r['name']}: Python garbage collection in the timed steps: {sum(ms):.1f} ms in all, "
                          f"at most {max(ms):.1f} ms in one step; step seconds {r['step_seconds']}"]
            host, clocks = r.get("host_ms_per_step") or [], [c for c in r.get("sm_clock_mhz_per_step") or [] if c]
            if host:
                lines[-1] += f"; host ms to issue each step {host}"
            if clocks:
                lines[-1] += f"; SM clock {min(clocks)}-{max(clocks)} MHz"
    notes = [f"- {r['name']}: {r['error'][:300]}" for r in result["paths"] if r.get("error")]
    notes += [f"- {r['name']}: {n}" for r in result["paths"] for n in r.get("notes", [])]
    notes += [f"- {n}" for n in result.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str:
    """bench.png: tokens/s and launches per step per path. Returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"skipped: matplotlib unavailable ({type(exc).__name__})"
    rows = [r for r in result["paths"] if r["status"] == "ok"]
    if not rows:
        return "skipped: no path ran"
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 1.8))
    axes[0].barh(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("real tokens / s")
    unit = rows[0]["launches"]["unit"]
    axes[1].barh(names, [r["launches"]["count"] for r in rows], color="tab:orange")
    axes[1].set_xlabel("kernel launches / step" if unit == "cuda_kernels" else "CPU ops / step")
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()
    m = result["model"]
    fig.suptitle(f"{m['shape']} x{m['layers']} layers, {m['finetune']}, {result['versions'].get('gpu') or 'cpu'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "written"


def write_outputs(result: dict, out: str, final: bool) -> None:
    os.makedirs(out, exist_ok=True)
    result["partial"] = not final
    result["paths"].sort(key=lambda r: list(PATHS).index(r["name"]))
    if final:
        result["png"] = plot(result, os.path.join(out, "bench.png"))
        if result["png"] != "written":
            result["notes"].append(f"bench.png {result['png']}")
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown(result))
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)


def environment(device: torch.device) -> dict:
    from axolotl_fastqwen.ops.availability import driver_version, versions

    v = versions()
    v["driver"] = driver_version() if device.type == "cuda" else None
    v["python"] = sys.version.split()[0]
    return v


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    names = parse_paths(args.paths)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.qlora and args.full:
        raise SystemExit("--qlora quantizes the frozen base for adapters: not with --full")
    start = time.time()
    start_perf = time.perf_counter()
    setup = prepare(args, steps_per_path=args.warmup + FIT_STEPS + 1 + args.steps)  # room for a fitting path
    w = setup.workload
    result = {
        "schema": SCHEMA,
        "command": ["python", "-m", "fastqwen_bench", "bench", *(argv if argv is not None else sys.argv[1:])],
        "args": vars(args),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(setup.device),
        "versions": environment(setup.device),
        "triton_hooks": dict(TRITON.hooks),
        "model": setup.info,
        "workload": {
            **w.describe(),
            "budget": w.budget,
            "micro_batch_size": setup.micro_batch_size,
            "micro_batch_size_rule": "given" if args.micro_batch_size else
            "mean sequences per packed row (about as many real tokens per padded step as per packed step)",
            "steps_per_path": {"warmup": args.warmup, "profiled": 1, "timed": args.steps},
        },
        "peak": setup.peak,
        "flops": {
            "formula": measure.MFU_FORMULA,
            "matmul_params_per_token": setup.matmul,
            "gdn_forward_flops_per_token_per_layer": measure.gdn_flops_per_token(setup.config),
            "lora_params": setup.lora_params,
        },
        "launch_unit": "cuda_kernels" if setup.device.type == "cuda" else
        "cpu_ops (no GPU: CPU operator events are counted instead of kernel launches)",
        "paths": [],
        "notes": [],
    }
    if setup.device.type != "cuda":
        result["notes"].append("CPU run: launches are CPU operator events, GPU time and peak memory are n/a, "
                               "MFU is relative to a CPU fp32 matmul (not meaningful)")
    log(f"[setup] stream: {w.describe()}; padded micro batch {setup.micro_batch_size}; paths: {', '.join(names)}")
    run_started = time.perf_counter()
    setup_seconds = run_started - start_perf
    result["setup_seconds"] = round(setup_seconds, 1)
    for k, name in enumerate(names):
        limit = path_budget(args, time.perf_counter() - start_perf, len(names) - k)
        if limit is not None and limit < MIN_PATH_SECONDS:
            result["paths"].append(budget_skip(name, limit))
            log(f"\n===== {name}: skipped, {limit:.0f} s of --max-total-seconds left for it")
            result["calibration"] = compare_calibration(result["paths"], setup.dtype)  # even with no path run yet
            write_outputs(result, args.out, final=False)
            continue
        record: dict = {}
        result["paths"].append(record)

        def progress(result=result):
            result["calibration"] = compare_calibration(result["paths"], setup.dtype)
            write_outputs(result, args.out, final=False)

        run_path(setup, name, limit=limit, record=record, progress=progress)
        progress()
    result["calibration"] = compare_calibration(result["paths"], setup.dtype)
    result["reference"] = reference_ratios(result["paths"])
    result["wall_seconds"] = round(time.time() - start, 1)
    write_outputs(result, args.out, final=True)
    png = ", bench.png" if result["png"] == "written" else ""
    log(f"\nwrote {os.path.join(args.out, 'bench.json')}, bench.md{png}\n")
    log(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
