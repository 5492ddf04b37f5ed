"""Measurements shared by `bench` and `profile`: launches, GPU time, compile/autotune counters, FLOPs.

Triton is instrumented at three points whose names have been stable from 3.0 to 3.8: the
`Autotuner.run` cache (a new tuning key is a (re-)autotune), `Autotuner._bench` (one config
benchmarked) and the JIT compile path (`JITFunction._do_compile` when present, else
`triton.compiler.compile`, which also serves kernels from the disk cache: any new specialisation
after warm-up is a red flag either way). Each hook is optional and recorded as installed or not.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time

import torch

# --------------------------------------------------------------------------------------------
# Triton and dynamo counters
# --------------------------------------------------------------------------------------------


class TritonCounters:
    """Process-wide counters of Triton autotuning and kernel compilation (installed once)."""

    def __init__(self):
        self.counts = collections.Counter()
        self.compiled: list[str] = []  # the kernel of each JITFunction compile, in order (which one re-specialised)
        self.hooks: dict[str, str] = {}
        self.installed = False

    def install(self) -> dict[str, str]:
        if self.installed:
            return self.hooks
        self.installed = True
        try:
            import triton  # noqa: F401
        except Exception as exc:  # no Triton (or a broken one): nothing to count
            self.hooks["triton"] = f"not importable: {type(exc).__name__}"
            return self.hooks
        self._hook_autotuner()
        self._hook_compile()
        return self.hooks

    def _hook_autotuner(self) -> None:
        try:
            from triton.runtime.autotuner import Autotuner
        except Exception as exc:
            self.hooks["autotuner"] = f"unavailable: {type(exc).__name__}"
            return
        counts = self.counts
        original_run = Autotuner.run

        @functools.wraps(original_run)
        def run(tuner, *args, **kwargs):
            cache = getattr(tuner, "cache", None)
            before = len(cache) if isinstance(cache, dict) else None
            out = original_run(tuner, *args, **kwargs)
            if before is not None and len(tuner.cache) > before:
                counts["autotune_new_keys"] += len(tuner.cache) - before
            return out

        Autotuner.run = run
        self.hooks["autotune_new_keys"] = "Autotuner.run (growth of its per-key cache)"
        if hasattr(Autotuner, "_bench"):
            original_bench = Autotuner._bench

            @functools.wraps(original_bench)
            def bench(tuner, *args, **kwargs):
                counts["autotune_benchmarks"] += 1
                return original_bench(tuner, *args, **kwargs)

            Autotuner._bench = bench
            self.hooks["autotune_benchmarks"] = "Autotuner._bench (one config timed)"

    def _hook_compile(self) -> None:
        counts, compiled = self.counts, self.compiled
        try:
            from triton.runtime.jit import JITFunction
        except Exception as exc:
            self.hooks["jit_compiles"] = f"unavailable: {type(exc).__name__}"
            return
        if hasattr(JITFunction, "_do_compile"):
            original = JITFunction._do_compile

            @functools.wraps(original)
            def do_compile(fn, *args, **kwargs):
                counts["jit_compiles"] += 1
                compiled.append(getattr(fn, "__name__", type(fn).__name__))
                return original(fn, *args, **kwargs)

            JITFunction._do_compile = do_compile
            self.hooks["jit_compiles"] = "JITFunction._do_compile (new specialisation: compiled or disk-cached)"
            return
        try:  # older layouts: JITFunction binds `triton.compiler.compile` when it creates a binder
            import triton.compiler as tc
            import triton.compiler.compiler as tcc

            original = tcc.compile

            @functools.wraps(original)
            def compile_(*args, **kwargs):
                counts["jit_compiles"] += 1
                return original(*args, **kwargs)

            tcc.compile = compile_
            tc.compile = compile_
            self.hooks["jit_compiles"] = "triton.compiler.compile (kernels bound after the hook)"
        except Exception as exc:
            self.hooks["jit_compiles"] = f"unavailable: {type(exc).__name__}"

    def snapshot(self) -> dict[str, int]:
        return {k: int(self.counts.get(k, 0)) for k in ("autotune_new_keys", "autotune_benchmarks", "jit_compiles")}


TRITON = TritonCounters()


def dynamo_snapshot() -> dict[str, int]:
    """torch._dynamo's global counters, flattened to 'group.key' (empty when dynamo is unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {f"{group}.{key}": int(value) for group, c in counters.items() for key, value in c.items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def recompiles(dynamo_delta: dict[str, int]) -> int:
    """New dynamo graphs or recompilations in a counters delta."""
    return sum(v for k, v in dynamo_delta.items() if k.startswith("recompiles.") or k == "stats.unique_graphs")


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


# What `axolotl train` sets before torch touches the GPU (axolotl/cli/main.py:
# set_pytorch_cuda_alloc_conf): the bench runs every path under the allocator a real run has.
AXOLOTL_ALLOC_CONF = "expandable_segments:True"
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def configure_allocator(mode: str) -> dict:
    """`--allocator axolotl`: expandable segments unless the environment already says otherwise
    (as Axolotl's CLI does); `default`: torch's own. Call before the first CUDA allocation."""
    given = {k: os.environ[k] for k in ALLOC_ENV if k in os.environ}
    if mode == "axolotl" and not given:
        os.environ["PYTORCH_ALLOC_CONF"] = AXOLOTL_ALLOC_CONF
        return {"mode": mode, "PYTORCH_ALLOC_CONF": AXOLOTL_ALLOC_CONF, "set_by": "bench (as axolotl train does)"}
    return {"mode": mode, **given, "set_by": "environment" if given else "torch default"}


def expandable_segments(device: torch.device) -> bool | None:
    """Whether the caching allocator is using expandable segments (read from its snapshot)."""
    if device.type != "cuda":
        return None
    segments = torch.cuda.memory._snapshot(device).get("segments", [])
    return any(seg.get("is_expandable", False) for seg in segments) if segments else None


class GcPauses:
    """Python's garbage collections and the time they held the host (`gc.callbacks`), per generation:
    a step that a collection stalls shows here (issue 36: the spread of the MoE step times)."""

    def __init__(self):
        import gc

        self._gc = gc
        self.ms = 0.0
        self.collections = collections.Counter()
        self._started = None
        self.installed = False

    def _callback(self, phase, info):
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.ms += (time.perf_counter() - self._started) * 1000
            self.collections[f"gen{info['generation']}"] += 1
            self._started = None

    def install(self) -> None:
        if not self.installed:
            self._gc.callbacks.append(self._callback)
            self.installed = True

    def snapshot(self) -> tuple[float, dict[str, int]]:
        return self.ms, dict(self.collections)


GC = GcPauses()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def allocated_gib(device: torch.device) -> float | None:
    """What is allocated now: after a path's cleanup, what it left for the paths after it."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.memory_allocated(device) / 2**30, 2)


def free_memory(device: torch.device) -> None:
    """Between paths: drop dead tensors and cached blocks so each path's peak is its own (GPU only:
    on a CPU run memory is not measured and a full gc pass costs ~0.5 s per call)."""
    import gc

    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def peak_matmul_tflops(device: torch.device, n: int | None = None, iters: int = 10) -> dict:
    """The achievable dense peak here: a big bf16 matmul (8192^3) on a GPU, fp32 512^3 on a CPU."""
    if device.type == "cuda":
        n = n or 8192
        dtype = torch.bfloat16
    else:
        n = n or 512
        dtype = torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    seconds = (time.perf_counter() - start) / iters
    del a, b
    return {
        "tflops": round(2 * n**3 / seconds / 1e12, 2),
        "method": f"{str(dtype).replace('torch.', '')} matmul {n}^3, mean of {iters} after 3 warm-up",
    }


# --------------------------------------------------------------------------------------------
# Launch counting with the profiler
# --------------------------------------------------------------------------------------------


def kineto_events(prof) -> list:
    """Raw profiler events (fast); falls back to FunctionEvents on torch builds without them."""
    with contextlib.suppress(Exception):
        return list(prof.profiler.kineto_results.events())
    return list(prof.events())


def _field(event, name: str, default=None):
    value = getattr(event, name, default)
    return value() if callable(value) else value


def is_device_event(event) -> bool:
    return "CUDA" in str(_field(event, "device_type", ""))


def is_kernel(event) -> bool:
    """A device kernel (not a memcpy / memset / GPU-side annotation)."""
    if not is_device_event(event):
        return False
    kind = _field(event, "activity_type", None)
    if isinstance(kind, str):
        return kind == "kernel"
    if _field(event, "is_user_annotation", False):  # GPU-side mirror of a record_function range
        return False
    name = _field(event, "name", "") or ""
    return not name.startswith(("Memcpy", "Memset", "ProfilerStep"))


def duration_us(event) -> float:
    ns = _field(event, "duration_ns", None)
    if ns is not None:
        return ns / 1000.0
    return float(getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0) or 0.0)


def start_us(event) -> float:
    ns = _field(event, "start_ns", None)
    if ns is not None:
        return ns / 1000.0
    return float(event.time_range.start)


def count_launches(fn, device: torch.device) -> dict:
    """Run `fn` once under the profiler; count what it launched.

    GPU: device kernels (and, separately, memcpy/memset), their summed time. CPU: there are no
    launches, so CPU operator events are counted instead (unit "cpu_ops").
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        result = fn()
        sync(device)
    wall = time.perf_counter() - start
    events = kineto_events(prof)
    if cuda:
        kernels = [e for e in events if is_kernel(e)]
        other = [e for e in events if is_device_event(e) and not is_kernel(e)]
        info = {
            "unit": "cuda_kernels",
            "count": len(kernels),
            "memcpy_memset": sum(1 for e in other if (_field(e, "name", "") or "").startswith(("Memcpy", "Memset"))),
            "gpu_kernel_ms": round(sum(duration_us(e) for e in kernels) / 1000.0, 2),
        }
    else:
        ops = [e for e in events if "CPU" in str(_field(e, "device_type", ""))]
        info = {"unit": "cpu_ops", "count": len(ops), "memcpy_memset": 0, "gpu_kernel_ms": None}
    info["profiled_step_wall_ms"] = round(wall * 1000, 1)
    return {"launches": info, "result": result}


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------

GDN_CHUNK = 64

MFU_FORMULA = (
    "model FLOPs per step = T_real * (c_w * N_mm + 3 * F_gdn) + 3 * sum_seq F_attn(L) [+ 6 * N_lora * T_real]; "
    "N_mm = weight-matrix parameters a token multiplies through (q|gate,k,v,o / GDN in_proj_qkv,z,b,a,out_proj / "
    "MLP or top-k experts + shared expert + router / lm_head; no embedding), c_w = 4 for LoRA (forward + "
    "input-gradient backward of the frozen weights) or 6 for full fine-tuning (+ weight gradients); "
    "F_attn(L) = 2 * L^2 * q_heads * head_dim per full-attention layer (causal half of 4*L^2*H*D: QK^T and PV), "
    "backward = 2x forward; F_gdn = per GDN layer and token, summed over value heads, the chunked delta rule's "
    "matmuls at chunk C=64: 6*Dk*Dv (state read, write, correction) + 6*C*Dk (QK^T, KK^T, W) + 4*C*Dv (U, intra "
    "output) + 2*C^2/3 (triangular solve) + 2*conv_width*conv_dim/H_v (depthwise conv), backward = 2x forward. "
    "Hardware FLOPs add the forward recomputed by gradient checkpointing: 2*(N_mm - N_lm_head)*T + F_gdn*T + "
    "sum F_attn, times the fraction of layers recomputed (fastqwen_checkpointing: auto recomputes fewer). "
    "Only real tokens count (padding is waste). MFU = model FLOPs / step time / peak; "
    "HFU = hardware FLOPs / step time / peak; peak = a measured 8192^3 bf16 matmul on this GPU."
)


def gdn_flops_per_token(config) -> float:
    """Forward FLOPs of one GDN layer's recurrence + conv for one token (all value heads)."""
    Dk, Dv, Hv = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_value_heads
    C = GDN_CHUNK
    per_head = 6 * Dk * Dv + 6 * C * Dk + 4 * C * Dv + 2 * C * C / 3
    conv_dim = 2 * config.linear_num_key_heads * Dk + Hv * Dv
    return Hv * per_head + 2 * config.linear_conv_kernel_dim * conv_dim


def attention_flops(lengths, config) -> float:
    """Forward FLOPs of all full-attention layers (causal) over sequences of `lengths`."""
    n_attn = list(config.layer_types).count("full_attention")
    per_layer = sum(2.0 * L * L * config.num_attention_heads * config.head_dim for L in lengths)
    return n_attn * per_layer


def step_flops(lengths, config, matmul: dict, *, full: bool, gc: float, lora_params: int = 0) -> dict:
    """Model and hardware FLOPs of one training step over sequences of `lengths` (real tokens);
    `gc`: the fraction of the decoder layers that gradient checkpointing recomputes (True: all)."""
    tokens = float(sum(lengths))
    n_gdn = list(config.layer_types).count("linear_attention")
    gdn_fwd = n_gdn * gdn_flops_per_token(config) * tokens
    attn_fwd = attention_flops(lengths, config)
    c_w = 6 if full else 4
    model = tokens * c_w * matmul["total"] + 3 * gdn_fwd + 3 * attn_fwd + 6 * lora_params * tokens
    hardware = model
    if gc:
        hardware += float(gc) * (2 * (matmul["total"] - matmul["lm_head"]) * tokens + gdn_fwd + attn_fwd)
    return {"model": model, "hardware": hardware}
