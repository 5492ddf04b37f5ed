"""Derive the `axolotl train` YAMLs of the H200 comparison from the examples, changing only what must.

Runs (--run):

* ``axolotl``: Axolotl 0.21's fastest configuration for Qwen3.5, from ``examples/qwen3_5-27b-lora.yml``
  without our plugin: Axolotl's multipack (``sample_packing: true``), its Triton LoRA kernels
  (``lora_mlp_kernel`` / ``lora_qkv_kernel`` / ``lora_o_kernel``), its fused q/k-norm + RoPE kernel
  for Qwen3.5's full-attention layers (``fused_attn_kernel``), and Liger (``LigerPlugin`` with
  ``liger_rms_norm``, ``liger_rms_norm_gated`` (Qwen3.5's GDN output norm),
  ``liger_glu_activation``, ``liger_fused_linear_cross_entropy``). Attention: sdpa (no flash-attn
  on the image). Plus ``fla_hopper_guard.LiftFlaHopperGuardPlugin``: fla raises in its gated GDN
  backward on Hopper with the image's Triton 3.6 (fla#640; Axolotl's own torch >= 2.13 brings
  Triton >= 3.7.1, where it does not); our plugin lifts that guard itself after its self-check.
* ``fastqwen``: the same file with ``axolotl_fastqwen.FastQwenPlugin`` added and
  ``sample_packing: false`` (the plugin's packer replaces multipack; everything else identical).
* ``qlora``: ``examples/qwen3_5-27b-qlora.yml`` as it is (plugin on, 4-bit NF4, adamw_bnb_8bit).
* ``fft``: ``examples/qwen3_5-27b-fft.yml`` on one GPU: its ``fsdp_config`` (8-GPU FSDP2) removed.
* ``example`` (issue 32): Axolotl's own ``examples/qwen3.5/27b-qlora.yaml`` (the copy in
  ``tests/axolotl_examples/``: its LoRA targets q/k/v/o/up/down, ``sample_packing: true``,
  gradient checkpointing with ``use_reentrant: false``, ``bf16: auto``), made runnable on the
  image and as fast as Axolotl goes: LoRA in bf16 (not 4-bit), Axolotl's speed options as for
  ``axolotl`` (its LoRA kernels, ``fused_attn_kernel``, Liger's RMSNorm / gated RMSNorm / SwiGLU /
  fused linear cross-entropy in place of the example's CutCrossEntropyPlugin, whose git-only fork
  is not on the image), ``adamw_torch_fused`` (the example's torchao 4-bit AdamW is not on the
  image), sdpa, and fla's Hopper guard lifted as for ``axolotl``.
* ``example-plugin``: ``example`` with ``axolotl_fastqwen.FastQwenPlugin`` appended to ``plugins:``
  and nothing else changed (the plugin then takes ``sample_packing`` over, and chooses
  ``fastqwen_checkpointing: auto`` by itself).
* ``vision`` (issue 34): Axolotl's own ``examples/qwen3.5/9b-lora-vision.yaml`` (the copy in
  ``tests/axolotl_examples/``) as written: ``processor_type: AutoProcessor``,
  ``skip_prepare_dataset``, ``sample_packing: false``, micro batch 1 (one image+text sample a
  micro-step), gradient accumulation 4, LoRA r=32 on q/k/v/o/up/down, 8-bit AdamW, bf16, tf32,
  gradient checkpointing, ``sequence_len`` 8192; only the local paths, a fixed seed, ``max_steps``,
  no eval or saves, sdpa for ``flash_attention_2`` (no flash-attn on the image), and fla's Hopper
  guard lifted as for ``axolotl`` (transformers' own GDN calls fla's kernels when it is installed).
* ``vision-plugin``: ``vision`` with ``axolotl_fastqwen.FastQwenPlugin`` appended to ``plugins:``
  and ``sample_packing: true`` (Axolotl cannot pack this data; with the plugin that key means
  "pack my data": its image+text packer fills rows of ``sequence_len`` x micro batch tokens).
* ``*-safe`` (``axolotl-safe``, ``fastqwen-safe``): without ``fused_attn_kernel`` and
  ``liger_rms_norm_gated``, the two newest Qwen3.5-specific switches; the driver retries with
  these when a run dies before its first step.

Every run gets the same local overrides: ``base_model`` (the checkpoint folder), the dataset path
(a local JSONL in the FineTome layout, so the examples' ``field_messages`` / role mappings stay),
``output_dir`` / ``dataset_prepared_path``, ``sequence_len`` = token budget, micro batch 1,
gradient accumulation 1 (one packed row of ``--budget`` tokens per optimizer step in both packers),
``max_steps``, a fixed seed, no eval split, no checkpoint saves, ``gradient_checkpointing`` as asked,
and the probe plugin (``train_probe.TrainProbePlugin``, tools/gpu on PYTHONPATH). ``--set k=v``
(v parsed as YAML) and ``--unset k`` apply last.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
FASTQWEN = "axolotl_fastqwen.FastQwenPlugin"
LIGER = "axolotl.integrations.liger.LigerPlugin"
PROBE = "train_probe.TrainProbePlugin"
FLA_GUARD = "fla_hopper_guard.LiftFlaHopperGuardPlugin"

sys.path.insert(0, str(REPO))
from fastqwen_bench.axolotl_best import SPEED_OPTIONS  # noqa: E402 (one list: the bench's axolotl-best)

AXOLOTL_FAST = {"sample_packing": True, **SPEED_OPTIONS, "liger_fused_linear_cross_entropy": True}
RISKY = ("fused_attn_kernel", "liger_rms_norm_gated")  # dropped by the *-safe variants
EXAMPLES = {
    "axolotl": "examples/qwen3_5-27b-lora.yml",
    "fastqwen": "examples/qwen3_5-27b-lora.yml",
    "qlora": "examples/qwen3_5-27b-qlora.yml",
    "fft": "examples/qwen3_5-27b-fft.yml",
    "example": "tests/axolotl_examples/27b-qlora.yaml",
    "example-plugin": "tests/axolotl_examples/27b-qlora.yaml",
    "vision": "tests/axolotl_examples/9b-lora-vision.yaml",
    "vision-plugin": "tests/axolotl_examples/9b-lora-vision.yaml",
}
VISION = ("vision", "vision-plugin")
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
# CPU smoke test only: what needs CUDA (Triton kernels, Liger, bf16 autocast) off.
CPU_OFF = {
    "bf16": False, "tf32": False, "fp16": False, "lora_mlp_kernel": False, "lora_qkv_kernel": False,
    "lora_o_kernel": False, "fused_attn_kernel": False, "liger_rms_norm": False, "liger_rms_norm_gated": False,
    "liger_glu_activation": False, "liger_fused_linear_cross_entropy": False, "dataloader_num_workers": 0,
    "dataloader_pin_memory": False,
}


def _plugins(cfg: dict, add: list[str], drop: list[str]) -> None:
    plugins = [p for p in (cfg.get("plugins") or []) if p not in drop]
    for p in add:
        if p not in plugins:
            plugins.append(p)
    cfg["plugins"] = plugins


def build(run: str, *, model: str, data: str, out_dir: str, prepared: str, budget: int, max_steps: int,
          seed: int, gradient_checkpointing: bool, cpu: bool = False, probe: bool = True) -> dict:
    base = run[: -len("-safe")] if run.endswith("-safe") else run
    if base not in EXAMPLES:
        raise SystemExit(f"unknown run {run!r}; known: {', '.join(list(EXAMPLES) + ['axolotl-safe', 'fastqwen-safe'])}")
    cfg = yaml.safe_load((REPO / EXAMPLES[base]).read_text())
    cfg = copy.deepcopy(cfg)
    if base in ("example", "example-plugin"):
        cfg.pop("load_in_4bit", None)
        cfg.update(AXOLOTL_FAST, adapter="lora", optimizer="adamw_torch_fused", bf16=True)
        _plugins(cfg, [LIGER], [CCE])
        cfg["plugins"] = [FLA_GUARD] + cfg["plugins"]
        if base == "example-plugin":
            cfg["plugins"].append(FASTQWEN)  # the one line, nothing else
    if base in ("axolotl", "fastqwen"):
        cfg.update(AXOLOTL_FAST)
        _plugins(cfg, [LIGER], [FASTQWEN])
        for key in [k for k in cfg if k.startswith("fastqwen_")]:
            del cfg[key]
        if base == "fastqwen":
            cfg["plugins"] = [FASTQWEN] + cfg["plugins"]  # "the same file with our plugin line added"
            cfg["sample_packing"] = False
        else:  # fla refuses its gated backward on Hopper + Triton 3.6 (fla#640); ours lifts it itself
            cfg["plugins"] = [FLA_GUARD] + cfg["plugins"]
    if base in VISION:
        return _vision(cfg, base, model=model, data=data, out_dir=out_dir, prepared=prepared, max_steps=max_steps,
                       seed=seed, cpu=cpu, probe=probe)
    if run.endswith("-safe"):
        for key in RISKY:
            cfg.pop(key, None)
    if base == "fft":
        cfg.pop("fsdp_config", None)  # the example shards over 8 GPUs; this is one
    if base in ("fastqwen", "qlora", "fft"):
        cfg["fastqwen_token_budget"] = budget
    _local_run(cfg, model=model, data=data, out_dir=out_dir, prepared=prepared, max_steps=max_steps, seed=seed)
    # the comparison's shape: one packed row of `budget` tokens per optimizer step in both packers
    cfg["sequence_len"] = budget
    cfg["micro_batch_size"] = 1
    cfg["gradient_accumulation_steps"] = 1
    cfg["gradient_checkpointing"] = bool(gradient_checkpointing)
    if gradient_checkpointing:
        cfg["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    else:
        cfg.pop("gradient_checkpointing_kwargs", None)
    cfg["dataset_num_proc"] = 4
    if probe:
        _plugins(cfg, [PROBE], [])
    if cpu:
        cfg.update(CPU_OFF)
        _plugins(cfg, [], [LIGER])
        cfg["dataset_num_proc"] = 1
        if cfg.get("optimizer") == "adamw_torch_fused":
            cfg["optimizer"] = "adamw_torch"
    return cfg


def _local_run(cfg: dict, *, model: str, data: str, out_dir: str, prepared: str, max_steps: int, seed: int) -> None:
    """What every run changes: local checkpoint, data and output paths, a timed run of `max_steps`
    with a fixed seed, every step logged, no eval split or saves, sdpa (no flash-attn on the image)."""
    cfg["base_model"] = model
    cfg["datasets"] = [{**cfg["datasets"][0], "path": data, "ds_type": "json", "split": "train"}]
    cfg.update(output_dir=out_dir, dataset_prepared_path=prepared, max_steps=max_steps, seed=seed, val_set_size=0.0,
               logging_steps=1, save_strategy="no", flash_attention=False, attn_implementation="sdpa")
    for key in ("evals_per_epoch", "saves_per_epoch"):
        cfg.pop(key, None)


def _vision(cfg: dict, base: str, *, model: str, data: str, out_dir: str, prepared: str, max_steps: int,
            seed: int, cpu: bool, probe: bool) -> dict:
    """The vision example as written; only what points it at local files and makes it a timed run."""
    cfg["plugins"] = [FLA_GUARD] + list(cfg.get("plugins") or [])  # as for `example`: fla#640 on Triton 3.6
    if base == "vision-plugin":
        _plugins(cfg, [FASTQWEN], [])
        cfg["sample_packing"] = True
    _local_run(cfg, model=model, data=data, out_dir=out_dir, prepared=prepared, max_steps=max_steps, seed=seed)
    if probe:
        _plugins(cfg, [PROBE], [])
    if cpu:
        cfg.update(bf16=False, tf32=False, optimizer="adamw_torch", dataloader_num_workers=0,
                   dataloader_pin_memory=False)
    return cfg


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants key=value, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--model", required=True, help="checkpoint folder (tokenizer inside)")
    p.add_argument("--data", required=True, help="chat JSONL (FineTome layout)")
    p.add_argument("--out-dir", required=True, help="Axolotl output_dir")
    p.add_argument("--prepared", required=True, help="dataset_prepared_path")
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--gc", action="store_true", help="gradient checkpointing on")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test: CUDA-only switches off")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--unset", action="append", default=[], metavar="KEY")
    p.add_argument("-o", "--output", required=True, help="YAML to write")
    args = p.parse_args(argv)
    cfg = build(args.run, model=args.model, data=args.data, out_dir=args.out_dir, prepared=args.prepared,
                budget=args.budget, max_steps=args.max_steps, seed=args.seed, gradient_checkpointing=args.gc,
                cpu=args.cpu, probe=not args.no_probe)
    cfg.update(_parse_set(args.set))
    for key in args.unset:
        cfg.pop(key, None)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    header = f"# generated by tools/gpu/make_train_config.py --run {args.run} from {EXAMPLES[args.run.removesuffix('-safe')]}\n"
    Path(args.output).write_text(header + yaml.safe_dump(cfg, sort_keys=False, width=110))
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
