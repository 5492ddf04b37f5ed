"""Benchmark path `axolotl-best`: Axolotl 0.21 as a speed-minded user configures it, applied by
Axolotl's own functions, in the order its loader applies them, on the benchmark's shared model.

The config (`best_config`) is what such a user writes for Qwen3.5 / Qwen3-Next LoRA:
`sample_packing: true`, `lora_mlp_kernel` / `lora_qkv_kernel` / `lora_o_kernel`,
`fused_attn_kernel`, Liger (`liger_rms_norm`, `liger_rms_norm_gated`, `liger_glu_activation`,
`liger_fused_linear_cross_entropy`) or `cut_cross_entropy` for the loss (two variants), and for
MoE models `use_scattermoe` (Axolotl's KernelsPlugin). Each piece is one `Component` of the path's
record: applied (with what it changed), refused (why: Axolotl's own condition, an import that
failed, a Triton kernel on a CPU run) or not applicable.

The order is Axolotl 0.21's `ModelLoader`: `PatchManager.apply_pre_model_load_patches`
(`_apply_self_attention_lora_patch` -> `_apply_model_specific_patches` (GDN packing patch, fused
attention) -> `_apply_multipack_patches` -> `_apply_sdpa_varlen_patch`), then the plugins'
`pre_model_load` (Liger, cut-cross-entropy, kernels/ScatterMoE), the model build,
`_configure_experts_implementation`, and after peft `apply_post_model_load_patches`
(`apply_lora_kernel_patches`).

One difference is forced by the benchmark's one shared model: Liger's (and Axolotl's Liger)
functions replace classes in the modeling module, which only affects modules built afterwards.
Here the model already exists, so after those patches the modules of a replaced class are
rebuilt through the patched names, from a meta-device skeleton of the model built with the same
config (what `from_pretrained` would construct), and take over the old modules' parameters and
children (the same tensors: LoRA adapters, optimizer and weights are untouched). Everything is
undone when the path ends (`restore.Undo`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from axolotl_fastqwen.families.base import unwrap
from axolotl_fastqwen import registry
from fastqwen_bench import cpu_fla, quantized_base
from fastqwen_bench.axolotl_import import axolotl_modules
from fastqwen_bench.common import PathSkipped
from fastqwen_bench.restore import Undo, changed_in_module, snapshot_module

LOSSES = ("liger", "cce")
LORA_KERNELS = "axolotl.monkeypatch.lora_kernels"
SCATTERMOE = "axolotl.integrations.kernels.libs.scattermoe_lora"
SDPA_VARLEN = "axolotl.monkeypatch.attention.sdpa_varlen"
MULTIPACK = "axolotl.monkeypatch.multipack"
CCE_PATCH = "cut_cross_entropy.transformers.patch"
CCE_INSTALL = ('Axolotl\'s fork: pip install "cut-cross-entropy[transformers] @ '
               'git+https://github.com/axolotl-ai-cloud/ml-cross-entropy.git@v0.1.1"')
TRITON_ONLY = "a Triton kernel: needs a CUDA device (this run is on {device})"


@dataclass
class Component:
    """One Axolotl setting of the path, as the record shows it."""

    key: str  # the Axolotl config key(s)
    function: str  # the function that applies it
    status: str = "pending"  # applied / refused / not applicable
    reason: str = ""  # why refused / not applicable
    effect: list[str] = field(default_factory=list)  # what it changed (applied)

    def applied(self, *effect: str) -> Component:
        self.status = "applied"
        self.effect += [e for e in effect if e]
        return self

    def refused(self, reason: str) -> Component:
        self.status, self.reason = "refused", reason
        return self

    def not_applicable(self, reason: str) -> Component:
        self.status, self.reason = "not applicable", reason
        return self


# Axolotl 0.21's speed options for Qwen3.5 LoRA (the loss option is chosen per variant); the GPU
# `axolotl train` recipe (tools/gpu/make_train_config.py) uses the same set
SPEED_OPTIONS = {
    "lora_mlp_kernel": True,
    "lora_qkv_kernel": True,
    "lora_o_kernel": True,
    "fused_attn_kernel": True,
    "liger_rms_norm": True,
    "liger_rms_norm_gated": True,
    "liger_glu_activation": True,
}


def best_config(family: str, loss: str, *, gc: bool, base_model: str, moe: bool):
    """The Axolotl config of the path, as the DictDefault Axolotl's functions read."""
    from axolotl.utils.dict import DictDefault

    cfg = {
        "base_model": base_model,
        "model_config_type": family,
        "adapter": "lora",
        "lora_dropout": 0.0,
        "sample_packing": True,
        "attn_implementation": "sdpa",
        "bf16": True,
        "gradient_checkpointing": gc,
        "torch_compile": False,
        **SPEED_OPTIONS,
        "liger_fused_linear_cross_entropy": loss == "liger",
        "cut_cross_entropy": loss == "cce",
        "cut_cross_entropy_accum_c_fp32": False,
    }
    if moe:
        cfg.update(use_kernels=False, use_scattermoe=True, experts_implementation="scattermoe")
    return DictDefault(cfg)


@contextlib.contextmanager
def _checkpoint_dir(config, family: str) -> Iterator[str]:
    """A local `base_model` folder holding the config a real checkpoint has (Axolotl's
    `get_attention_cls_from_config` reads it with AutoConfig; no weights)."""
    import transformers

    name = registry.family(family).composite_config  # Qwen3.5 checkpoints are the VL wrapper
    text = config.to_dict()
    with tempfile.TemporaryDirectory(prefix="fastqwen-axolotl-best-") as folder:
        if name:
            getattr(transformers, name)(text_config=text).save_pretrained(folder)
        else:
            config.save_pretrained(folder)
        yield folder


def _modules_needed(family: str, loss: str, moe: bool) -> list[str]:
    axolotl = registry.family(family).axolotl
    names = [axolotl.packing[0], LORA_KERNELS, SDPA_VARLEN, MULTIPACK, "axolotl.utils.dict", axolotl.liger[0]]
    if axolotl.fused_attn:
        names.append(axolotl.fused_attn[0])
    if moe:
        names += [f"{SCATTERMOE}.experts", f"{SCATTERMOE}.runtime"]
    if loss == "cce":
        names.append(CCE_PATCH)
    return names


def _count(model, predicate) -> int:
    return sum(1 for m in model.modules() if predicate(m))


def _bound(module, key: str):
    fn = vars(module).get(key)
    return getattr(fn, "__func__", None)


@contextlib.contextmanager
def axolotl_best(model, family: str, device: torch.device, dtype: torch.dtype, *, loss: str,
                 gc: bool, assume_cuda: bool = False, overrides: dict | None = None) -> Iterator[dict]:
    """Install the path on `model` (the peft model); yields the record's info; undoes all on exit.
    `overrides`: config keys set otherwise than in the best configuration (a variant of it).

    `assume_cuda` (tests only): take the CUDA branches on a CPU model, to check that their set-up
    applies and is undone; such a model cannot run a forward (the kernels are Triton)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}")
    if importlib.util.find_spec("axolotl") is None:
        raise PathSkipped("Axolotl is not installed")
    if registry.family(family).axolotl is None:
        raise PathSkipped(f"Axolotl has no patches for {family}")
    moe = registry.family(family).moe
    base = unwrap(model)
    info: dict = {"notes": [], "components": []}
    with axolotl_modules(_modules_needed(family, loss, moe)) as (mods, stood_in, errors), \
            _checkpoint_dir(base.config, family) as checkpoint:
        if "axolotl.utils.dict" not in mods:
            raise PathSkipped(f"Axolotl does not import here: {errors.get('axolotl.utils.dict')}")
        cfg = best_config(family, loss, gc=gc, base_model=checkpoint, moe=moe)
        cfg.update(quantized_base.axolotl_keys(base, moe))  # a --qlora base: Axolotl's QLoRA code paths
        cfg.update(overrides or {})
        info["axolotl_config"] = {k: v for k, v in cfg.items() if k != "base_model"}
        info["axolotl_config"]["base_model"] = f"(a folder with the {registry.family(family).composite_config or 'text'} config)"
        if stood_in:
            info["stood_in"] = stood_in
            info["notes"].append(f"stood in for Axolotl's imports (bench/axolotl_import.py): {'; '.join(stood_in)}")
        undo = Undo()
        setup = _Setup(model, base, family, device, dtype, cfg, mods, errors, undo, info, loss, moe)
        setup.cuda = setup.cuda or assume_cuda
        try:
            setup.apply()
            info["components"] = [asdict(c) for c in setup.components]
            yield info
        finally:
            undo.restore()


class _Setup:
    def __init__(self, model, base, family, device, dtype, cfg, mods, errors, undo, info, loss, moe):
        self.model, self.base, self.family, self.device, self.dtype = model, base, family, device, dtype
        self.cfg, self.mods, self.errors, self.undo, self.info = cfg, mods, errors, undo, info
        self.loss, self.moe = loss, moe
        self.cuda = device.type == "cuda"
        self.axolotl = registry.family(family).axolotl
        self.modeling = importlib.import_module(registry.family(family).modeling_module)
        self.components: list[Component] = []

    # ---------------------------------------------------------------- helpers

    def component(self, key: str, function: str) -> Component:
        c = Component(key, function)
        self.components.append(c)
        return c

    def fn(self, module: str, name: str):
        """Axolotl's function, or raise ImportError with the recorded reason."""
        if module not in self.mods:
            raise ImportError(f"import {module} failed: {self.errors.get(module, 'not imported')}")
        return getattr(self.mods[module], name)

    def attempt(self, c: Component, action) -> Component:
        """Run `action(c)`; an exception refuses the component (the path goes on)."""
        try:
            action(c)
        except Exception as exc:
            c.refused(f"{type(exc).__name__}: {str(exc)[:400]}")
        return c

    # ---------------------------------------------------------------- the sequence

    def apply(self) -> None:
        undo = self.undo
        modeling_saved = self._modeling_saved = undo.module(self.modeling)
        undo.instances(self.model)
        undo.attr(self.base.config, "_experts_implementation_internal")
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        undo.interface(ALL_ATTENTION_FUNCTIONS)
        undo.interface(ALL_MASK_ATTENTION_FUNCTIONS)
        for name in (self.axolotl.packing[0], SDPA_VARLEN, LORA_KERNELS):
            if name in self.mods:
                undo.module(self.mods[name])

        # PatchManager.apply_pre_model_load_patches
        self.self_attn_lora()
        self.packing()
        self.fused_attn()
        self.multipack()
        self.sdpa_varlen()
        # plugins' pre_model_load
        self.liger()
        self.cce()
        self.scattermoe_register()
        # the model build, then ModelLoader._configure_experts_implementation
        self.rebuild(modeling_saved)
        self.experts_implementation()
        # PatchManager.apply_post_model_load_patches
        self.lora_kernels()

    def self_attn_lora(self) -> None:
        c = self.component("lora_qkv_kernel, lora_o_kernel (attention forward)",
                           "axolotl.monkeypatch.lora_kernels.patch_self_attn_lora(cfg)")
        if not (self.cfg.lora_qkv_kernel or self.cfg.lora_o_kernel):  # PatchManager's own condition
            c.not_applicable("lora_qkv_kernel and lora_o_kernel are off")
            return

        def act(c):
            before = snapshot_module(self.modeling)
            self.fn(LORA_KERNELS, "patch_self_attn_lora")(self.cfg)
            changed = [x for x in changed_in_module(self.modeling, before) if x.endswith(".forward")]
            if not changed:
                raise RuntimeError("patch_self_attn_lora changed no attention forward")
            c.applied(f"rewrote {', '.join(changed)} to call apply_qkv / apply_o")

        self.attempt(c, act)

    def undo_saved(self) -> dict:
        return self._modeling_saved

    def packing(self) -> None:
        module, name = self.axolotl.packing
        c = self.component("sample_packing (GDN packing patch)", f"{module}.{name}(torch_compile=False)")

        def act(c):
            patch = self.fn(module, name)
            notes = []
            if not self.cuda:
                note = cpu_fla.install(self.undo, self.mods[module], self.family)
                if note:
                    notes.append(note)
                    self.info["notes"].append(note)
            before = snapshot_module(self.modeling)
            patch(torch_compile=False)
            changed = changed_in_module(self.modeling, before)
            c.applied(f"changed {', '.join(x for x in changed if x.endswith('.forward'))}", *notes)

        self.attempt(c, act)

    def fused_attn(self) -> None:
        if self.axolotl.fused_attn is None:
            self.component("fused_attn_kernel", "-").not_applicable(
                f"Axolotl 0.21 has no fused q/k-norm + RoPE patch for {self.family} (its loader's set: qwen3, "
                "qwen3_moe, qwen3_vl, qwen3_5, qwen3_5_moe, gemma4)")
            return
        module, name = self.axolotl.fused_attn
        c = self.component("fused_attn_kernel", f"{module}.{name}()")
        if not self.cuda:
            c.refused("Axolotl applies it only when torch.cuda.is_available() "
                      f"(PatchManager._apply_model_specific_patches); its fused_rms_norm_rope is "
                      f"{TRITON_ONLY.format(device=self.device.type)}")
            return

        def act(c):
            before = vars(self.modeling_attention_cls()).get("forward")
            self.fn(module, name)()
            if vars(self.modeling_attention_cls()).get("forward") is before:
                raise RuntimeError("the attention forward did not change")
            c.applied(f"{self.modeling_attention_cls().__name__}.forward = Axolotl's fused forward "
                      "(q/k RMSNorm + partial RoPE in one Triton kernel; calls apply_qkv / apply_o)")

        self.attempt(c, act)

    def modeling_attention_cls(self):
        prefix = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_next": "Qwen3Next"}[self.family]
        return getattr(self.modeling, f"{prefix}Attention")

    def multipack(self) -> None:
        c = self.component("sample_packing (multipack model patch)",
                           "axolotl.monkeypatch.multipack.patch_for_multipack(model_type, has_remote_code=False)")

        def act(c):
            self.fn(MULTIPACK, "patch_for_multipack")(self.family, model_name=self.cfg.base_model,
                                                      has_remote_code=False)
            c.applied("no change: for in-tree models Axolotl's function patches only remote code (and mixtral "
                      "under ZeRO-3); packing isolation comes from the GDN patch and the attention mask / "
                      "sdpa_varlen. Its multipack dataloader patch is not used: the bench builds the rows")

        self.attempt(c, act)

    def sdpa_varlen(self) -> None:
        c = self.component("sdpa_varlen (auto: attn_implementation sdpa + sample_packing)",
                           "axolotl.monkeypatch.attention.sdpa_varlen.patch_sdpa_varlen()")
        head_dim = self.base.config.head_dim
        if not (self.cuda and self.dtype in (torch.float16, torch.bfloat16)):
            c.refused("Axolotl enables it only for CUDA fp16/bf16 (PatchManager._apply_sdpa_varlen_patch: "
                      "varlen_attn has no CPU or fp32 kernel); stock SDPA with the block-diagonal mask instead")
            return
        if head_dim > 256:
            c.refused(f"head_dim {head_dim} > 256 (Axolotl's _VARLEN_MAX_HEAD_DIM)")
            return

        def act(c):
            mod = self.mods[SDPA_VARLEN]
            if not mod.varlen_available():
                raise RuntimeError("torch.nn.attention.varlen.varlen_attn unavailable (torch < 2.10)")
            if not mod.patch_sdpa_varlen():
                raise RuntimeError("patch_sdpa_varlen() returned False")
            c.applied("registered Axolotl's varlen wrapper as the 'sdpa' attention and mask functions "
                      "(cu_seqlens from position_ids, no 4D mask)")

        self.attempt(c, act)

    def liger(self) -> None:
        module, name = self.axolotl.liger
        flags = ["liger_rms_norm", "liger_rms_norm_gated", "liger_glu_activation"]
        if self.loss == "liger":
            flags.append("liger_fused_linear_cross_entropy")
        comps = {f: self.component(f, f"{module}.{name}(...)") for f in flags}
        if self.loss != "liger":
            self.component("liger_fused_linear_cross_entropy", "-").not_applicable(
                "this variant's loss is cut_cross_entropy")
        if self.family == "qwen3_next":
            comps["liger_rms_norm_gated"].not_applicable(
                "Liger's qwen3_next function has no gated-norm option (Axolotl's gated norm is for qwen3_5*)")
            if self.moe and self.cfg.use_scattermoe:
                comps["liger_glu_activation"].refused(
                    "on qwen3_next Liger's swiglu replaces the routed experts' class with LigerExperts (a per-"
                    "expert loop), which would bypass use_scattermoe; a speed-minded config keeps ScatterMoE")
        live = {f: c for f, c in comps.items() if c.status == "pending"}
        if not self.cuda:
            for c in live.values():
                c.refused(f"Liger's kernels are Triton: need a CUDA device (this run is on {self.device.type})")
            return
        try:
            apply = self.fn(module, name)
        except Exception as exc:
            for c in live.values():
                c.refused(f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        if self.family == "qwen3_next":  # LigerPlugin's kwargs from the function signature
            kwargs = dict(rope=False, cross_entropy=False, fused_linear_cross_entropy="liger_fused_linear_cross_entropy"
                          in live, rms_norm="liger_rms_norm" in live, swiglu="liger_glu_activation" in live)
        else:
            kwargs = dict(cross_entropy=False, fused_linear_cross_entropy="liger_fused_linear_cross_entropy" in live,
                          glu_activation="liger_glu_activation" in live, rms_norm="liger_rms_norm" in live,
                          rms_norm_gated="liger_rms_norm_gated" in live, layer_norm=False)
        before = snapshot_module(self.modeling)
        try:
            apply(**kwargs)
        except Exception as exc:
            for c in live.values():
                c.refused(f"{name}({kwargs}) raised {type(exc).__name__}: {str(exc)[:300]}")
            return
        changed = changed_in_module(self.modeling, before)
        prefix = self.modeling_attention_cls().__name__.removesuffix("Attention")
        targets = {
            "liger_rms_norm": f"{prefix}RMSNorm",
            "liger_rms_norm_gated": f"{prefix}RMSNormGated",
            "liger_glu_activation": f"{prefix}Experts" if self.family == "qwen3_next" else f"{prefix}MLP",
            "liger_fused_linear_cross_entropy": f"{prefix}ForCausalLM.forward",
        }
        for flag, c in live.items():
            if targets[flag] in changed:
                c.applied(f"{targets[flag]} replaced (class-level)")
            else:
                c.refused(f"{name} did not change {targets[flag]}")

    def cce(self) -> None:
        if self.loss != "cce":
            return
        c = self.component("cut_cross_entropy", f"{CCE_PATCH}.cce_patch(model_type, accum_c_fp32=False)")
        if not self.cuda:
            c.refused(f"cut-cross-entropy's kernels are Triton: need a CUDA device (this run is on {self.device.type})")
            return
        if CCE_PATCH not in self.mods:
            c.refused(f"not installed ({self.errors.get(CCE_PATCH, '')[:120]}); PyPI's cut-cross-entropy 25.1.1 is "
                      f"Apple's upstream without cut_cross_entropy.transformers, which Axolotl refuses; {CCE_INSTALL}")
            return

        def act(c):
            patch = self.mods[CCE_PATCH]
            if not getattr(patch, "AXOLOTL_CCE_FORK", None):
                raise ImportError(f"cut_cross_entropy is not Axolotl's fork (no AXOLOTL_CCE_FORK); {CCE_INSTALL}")
            model_type = self.base.config.model_type  # the text model's type: its *ForCausalLM is what runs
            patch.cce_patch(model_type, remote_model_id=None, accum_c_fp32=False)
            cls = type(self.base)
            if vars(cls).get("forward") is self.undo_saved()["classes"].get(cls, {}).get("forward"):
                raise RuntimeError(f"cce_patch({model_type!r}) did not change {cls.__name__}.forward")
            c.applied(f"{cls.__name__}.forward = cut-cross-entropy's forward (model_type {model_type})")

        self.attempt(c, act)

    def scattermoe_register(self) -> None:
        if not self.moe:
            self.component("use_scattermoe", "-").not_applicable("dense model: no experts")
            return
        c = self.component("use_scattermoe (KernelsPlugin.pre_model_load)",
                           f"{SCATTERMOE}.experts.register_scattermoe_experts(); "
                           f"{SCATTERMOE}.runtime.configure_scattermoe_runtime(cfg)")
        self.scattermoe = c
        if not self.cuda:
            c.refused(f"ScatterMoE's kernels are Triton: need a CUDA device (this run is on {self.device.type})")
            return

        def act(c):
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
            from transformers.modeling_utils import PreTrainedModel

            experts_mod = self.mods[f"{SCATTERMOE}.experts"]
            runtime_mod = self.mods[f"{SCATTERMOE}.runtime"]
            self.undo.module(experts_mod)
            self.undo.interface(ALL_EXPERTS_FUNCTIONS)
            self.undo.attr(PreTrainedModel, "get_correct_experts_implementation")
            try:
                from peft.tuners.lora.layer import ParamWrapper

                self.undo.attr(ParamWrapper, "forward")
            except ImportError:
                pass
            self.undo.call(runtime_mod.RUNTIME.reset)
            experts_mod.register_scattermoe_experts()
            runtime_mod.configure_scattermoe_runtime(self.cfg)
            c.applied("registered 'scattermoe' in transformers' ExpertsInterface (and peft's ParamWrapper fast "
                      "path for expert LoRA); all undone after the path, except the aten.add / FSDP handlers it "
                      "registers on torchao's NVFP4Tensor / MXTensor when torchao is installed (FP4 tensors only, "
                      "which no path uses)")

        self.attempt(c, act)

    def experts_implementation(self) -> None:
        if not self.moe:
            return
        c = self.component("experts_implementation: scattermoe (ModelLoader._configure_experts_implementation)",
                           "model.set_experts_implementation('scattermoe')")
        if self.scattermoe.status != "applied":
            c.refused(f"use_scattermoe was refused: {self.scattermoe.reason[:200]}")
            return

        def act(c):
            before = self.base.config._experts_implementation
            if hasattr(self.base, "set_experts_implementation"):
                self.base.set_experts_implementation("scattermoe")
                how = "set_experts_implementation"
            else:  # transformers without the setter: the config field its decorator reads
                self.base.config._experts_implementation = "scattermoe"
                how = "config._experts_implementation"
            now = self.base.config._experts_implementation
            if now != "scattermoe":
                raise RuntimeError(f"experts implementation is {now!r} after {how}")
            n = _count(self.base, lambda m: type(m).__name__.endswith("Experts"))
            c.applied(f"{before} -> scattermoe on {n} experts modules (via {how})")

        self.attempt(c, act)

    def rebuild(self, modeling_saved: dict) -> None:
        """Modules of a class the patches replaced, rebuilt through the patched names."""
        replaced = {}
        for name, old in modeling_saved["globals"].items():
            new = vars(self.modeling).get(name)
            if isinstance(old, type) and new is not old and new is not None:
                replaced[old] = name
        targets = [(path, m) for path, m in self.base.named_modules() if type(m) in replaced]
        if not targets:
            return
        c = self.component("(model construction with the patched classes)",
                           "bench: meta-device skeleton of the model class, its modules of replaced classes moved "
                           "in with the old modules' parameters and children")
        try:
            from fastqwen_bench.shapes import _no_init

            with torch.device("meta"), _no_init():
                skeleton = type(self.base)(copy.deepcopy(self.base.config))
            built = dict(skeleton.named_modules())
            counts = Counter()
            for path, old in targets:
                key = ".".join(p for p in path.split(".") if p != "base_layer")
                new = built[key]
                _take_over(old, new)
                parent_path, _, leaf = path.rpartition(".")
                parent = self.base.get_submodule(parent_path) if parent_path else self.base
                self.undo.swap(parent, leaf, old, new)
                counts[f"{type(old).__name__} -> {type(new).__name__}"] += 1
            c.applied(*(f"{n} x {what}" for what, n in sorted(counts.items())))
        except Exception as exc:
            c.refused(f"{type(exc).__name__}: {str(exc)[:400]}")

    def lora_kernels(self) -> None:
        fn = "axolotl.monkeypatch.lora_kernels.apply_lora_kernel_patches(model, cfg)"
        comps = {k: self.component(f"{k} (per-module kernels)", fn)
                 for k in ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel")}
        if not any(self.cfg[k] for k in comps):  # PatchManager._apply_lora_kernel_patch's condition
            for c in comps.values():
                c.not_applicable("off in this configuration")
            return
        cfg = type(self.cfg)(dict(self.cfg))
        if not self.cuda:
            cfg["lora_mlp_kernel"] = False
            comps["lora_mlp_kernel"].refused(
                f"LoRA_MLP's SwiGLU (axolotl.kernels.swiglu) is {TRITON_ONLY.format(device=self.device.type)}; "
                "left out of the cfg passed to apply_lora_kernel_patches (the QKV / O / GDN-projection kernels "
                "are torch autograd functions and run here)")
        try:
            self.fn(LORA_KERNELS, "apply_lora_kernel_patches")(model=self.model, cfg=cfg)
            lora = importlib.import_module("axolotl.kernels.lora")
        except Exception as exc:
            for c in comps.values():
                if c.status == "pending":
                    c.refused(f"{type(exc).__name__}: {str(exc)[:400]}")
            return
        m = self.base
        n_qkv = _count(m, lambda x: _bound(x, "apply_qkv") is lora.apply_lora_qkv)
        n_o = _count(m, lambda x: _bound(x, "apply_o") is lora.apply_lora_o)
        n_in = _count(m, lambda x: "apply_in_proj_fused" in vars(x))
        n_out = _count(m, lambda x: "apply_out_proj" in vars(x))
        n_mlp = _count(m, lambda x: _bound(x, "forward") in (lora.apply_lora_mlp_swiglu, lora.apply_lora_mlp_geglu))
        gdn_names = ("; qwen3_next's fused in_proj_qkvz / in_proj_ba do not match Axolotl's GDN projection names "
                     "(in_proj_qkv/z/b/a), so its GDN projections stay on peft" if self.family == "qwen3_next" else "")
        results = {
            "lora_qkv_kernel": (n_qkv + n_in, f"{n_qkv} attention q/k/v (LoRA_QKV), {n_in} GDN in-projection groups "
                                              f"(LoRA_FusedProj over in_proj_qkv/z/b/a){gdn_names}"),
            "lora_o_kernel": (n_o + n_out, f"{n_o} attention o_proj (LoRA_O), {n_out} GDN out_proj"),
            "lora_mlp_kernel": (n_mlp, f"{n_mlp} MLPs (LoRA_MLP with the Triton SwiGLU)"),
        }
        for key, c in comps.items():
            if c.status != "pending":
                continue
            n, what = results[key]
            if n:
                c.applied(what)
            elif key == "lora_mlp_kernel" and self.moe:
                c.not_applicable("Axolotl's find_mlp_in_layer matches only a dense layer.mlp with gate/up/down; in "
                                 "this MoE model that is the sparse block, so no MLP (shared or routed experts) is "
                                 "LoRA_MLP-fused")
            else:
                c.refused(f"apply_lora_kernel_patches patched no module for it ({what})")
        glu = next((c for c in self.components if c.key == "liger_glu_activation"), None)
        if n_mlp and glu is not None and glu.status == "applied":
            glu.effect.append(f"then, as in Axolotl with both flags on, lora_mlp_kernel rebinds the forward of those "
                              f"{n_mlp} dense MLPs to LoRA_MLP (Liger's SwiGLU class stays for MLPs it does not match)")


def _take_over(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """`new` (built on meta) takes `old`'s parameters, buffers and children by name."""
    for name in list(new._parameters):
        if name not in old._parameters:
            raise KeyError(f"{type(new).__name__}.{name} has no counterpart in {type(old).__name__}")
        new._parameters[name] = old._parameters[name]
    for name in list(new._buffers):
        if name in old._buffers:
            new._buffers[name] = old._buffers[name]
        elif new._buffers[name] is not None and new._buffers[name].is_meta:
            raise KeyError(f"buffer {type(new).__name__}.{name} has no counterpart in {type(old).__name__}")
    for name, child in list(new._modules.items()):
        if name in old._modules:
            new._modules[name] = old._modules[name]
        elif child is not None and any(t.is_meta for t in [*child.parameters(), *child.buffers()]):
            raise KeyError(f"submodule {type(new).__name__}.{name} has no counterpart in {type(old).__name__}")
    new.train(old.training)
