"""Axolotl's own Qwen3.5 / Qwen3-Next example YAMLs, with only the plugin line added, train.

`tests/axolotl_examples/` holds Axolotl's examples on the tiny offline checkpoints (see its
README). Each test adds `axolotl_fastqwen.FastQwenPlugin` to `plugins:` and nothing else of the
plugin's, runs a real `axolotl train` on the CPU, and checks what the plugin did with the keys the
user wrote: `sample_packing` became the plugin's packer at the same tokens per step (one static
row shape, reported against the multipack rows it replaced), `attn_implementation:
flash_attention_2` without flash-attn ran sdpa outside the decoder's attention, and so on.

Keys that cannot run on a CPU machine at all, with or without the plugin, are changed by
`on_cpu` (and only those, each with the reason); `test_what_a_cpu_user_gets_for_a_gpu_only_key`
shows the message such a key gives on a CPU.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from axolotl_runs import ROOT, fails, report, train, train_losses

pytest.importorskip("axolotl")
pytestmark = [pytest.mark.axolotl, pytest.mark.slow]

HERE = Path(__file__).resolve().parent / "axolotl_examples"
EXAMPLES = sorted(p.name for p in HERE.glob("*.yaml"))
VISION = "9b-lora-vision.yaml"  # image+text: Axolotl's processor pipeline, sample_packing: false as it must be there
TEXT = [name for name in EXAMPLES if name != VISION]
PLUGIN = "axolotl_fastqwen.FastQwenPlugin"

# What a CPU machine cannot run, with or without the plugin: key -> (value here, why).
CPU_KEYS = {
    "tf32": (False, "TF32 needs an Ampere or newer GPU: HF's TrainingArguments refuses it on a CPU"),
    "bf16": (False, "`bf16: auto` resolves to fp16 on a CPU, run without autocast: fp16 weights meet fp32 "
                    "activations (Axolotl alone fails the same way on the full fine-tune and the MoE examples)"),
    "lora_qkv_kernel": (False, "Axolotl's Triton LoRA kernels need CUDA (Axolotl turns them on for LoRA by itself)"),
    "lora_o_kernel": (False, "as lora_qkv_kernel"),
    "lora_mlp_kernel": (False, "as lora_qkv_kernel"),
    "quantize_moe_experts": (False, "bitsandbytes quantizes the routed experts onto a CUDA device at load"),
    "activation_offloading": ("legacy", "the default offloader syncs CUDA streams; `legacy` offloads the same "
                                        "activations without them"),
    "fsdp_config": (None, "Axolotl builds FSDP2's device mesh on CUDA devices "
                          "(axolotl.utils.distributed.build_parallelism_config), even on CPU ranks"),
}
# Plugins of the examples that cannot run here, and the keys that belong to them.
CPU_PLUGINS = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": (
        (), "needs Axolotl's fork of cut-cross-entropy, which installs only from git (no PyPI release)"),
    "axolotl.integrations.kernels.KernelsPlugin": (
        ("use_kernels", "use_scattermoe", "use_sonicmoe", "nvfp4_merge_aware"),
        "its MoE kernels are Triton (CUDA) and `use_kernels` downloads kernels from the hub"),
    "axolotl.integrations.liger.LigerPlugin": (
        ("liger_layer_norm", "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_rms_norm_gated"),
        "Liger's kernels are Triton (CUDA)"),
}


def on_cpu(raw: dict) -> tuple[dict, dict]:
    """The example as a CPU machine can run it, and what was changed (key -> why)."""
    cfg = copy.deepcopy(raw)
    changed = {}
    for plugin, (keys, why) in CPU_PLUGINS.items():
        if plugin in (cfg.get("plugins") or []):
            cfg["plugins"].remove(plugin)
            changed[plugin] = why
            for key in keys:
                if cfg.pop(key, None) is not None:
                    changed[key] = f"belongs to {plugin.rsplit('.', 1)[-1]}"
    for key, (value, why) in CPU_KEYS.items():
        if key in cfg and cfg[key] not in (value, None):
            changed[key] = why
            if value is None:
                cfg.pop(key)
            else:
                cfg[key] = value
    # Axolotl turns its LoRA kernels on by itself for LoRA / QLoRA unless they are set false
    for key in ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel"):
        cfg.setdefault(key, False)
    return cfg, changed


def with_the_line(name: str, tmp_path: Path, **overrides) -> tuple[Path, dict]:
    raw = yaml.safe_load((HERE / name).read_text())
    cfg, changed = on_cpu(raw)
    cfg["plugins"] = [*(cfg.get("plugins") or []), PLUGIN]  # the one line
    cfg.update(output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prepared"), max_steps=3)
    for key, value in overrides.items():  # None removes the key
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path, changed


@pytest.fixture(scope="module", autouse=True)
def assets():
    from tiny_assets import write_assets

    write_assets(ROOT / ".assets")


def test_the_examples_are_axolotls_and_carry_the_keys_users_write():
    """The keys issue 32 names, as Axolotl's examples use them together."""
    keys = set()
    for name in EXAMPLES:
        raw = yaml.safe_load((HERE / name).read_text())
        assert raw["sample_packing"] is (name != VISION) and PLUGIN not in (raw.get("plugins") or []), name
        keys |= set(raw)
    assert {"sample_packing", "val_set_size", "evals_per_epoch", "saves_per_epoch", "gradient_checkpointing",
            "gradient_checkpointing_kwargs", "activation_offloading", "lora_target_modules", "lora_target_parameters",
            "unfrozen_parameters", "chat_template", "quantize_moe_experts", "use_kernels", "use_scattermoe",
            "use_sonicmoe", "bf16", "optimizer", "fsdp_config", "load_in_4bit", "attn_implementation"} <= keys
    optimizers = {yaml.safe_load((HERE / n).read_text())["optimizer"] for n in EXAMPLES}
    assert {"adamw_torch_4bit", "adamw_torch_8bit", "adamw_bnb_8bit"} <= optimizers


@pytest.mark.parametrize("name", TEXT)
def test_the_example_trains_with_only_the_plugin_line(name, tmp_path):
    path, changed = with_the_line(name, tmp_path)
    log = train(path)
    r = report(tmp_path / "out")
    settings, kernels, packing = r["settings"], r["kernels"], r["packing"]
    raw = yaml.safe_load((HERE / name).read_text())
    budget = -(-raw["sequence_len"] * raw["micro_batch_size"] // 64) * 64
    # sample_packing: the plugin's packer at multipack's tokens per step, compared with it in the report
    assert settings["rows"] == "fastqwen" and settings["token_budget"] == budget
    assert any(d.startswith("sample_packing: true: Axolotl's multipack replaced by the plugin's packer")
               for d in settings["decisions"])
    assert packing["replaced"] == "multipack" and packing["multipack"]["micro_batch_size"] == raw["micro_batch_size"]
    assert kernels["batch_shapes"]["train"] == [[1, budget]]  # one static shape
    assert kernels["boundary_sources"] == ["collator"]
    # attn_implementation: flash_attention_2 (no flash-attn here) ran sdpa beside the plugin's attention
    assert any(d.startswith("attn_implementation: flash_attention_2 -> sdpa") for d in settings["decisions"])
    # gradient checkpointing on a CPU: full, and the report says why auto did not run
    assert settings["checkpointing"] == "full"
    assert any("no CUDA device" in n for n in kernels["notes"]) or "activation_offloading" in changed
    losses = train_losses(log)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert "Traceback" not in log
    if raw.get("unfrozen_parameters"):  # the full fine-tune trains the language model only
        assert settings["lean_activations"] is False  # every layer recomputed: nothing kept to drop
    if raw.get("lora_target_parameters"):
        assert any("runs factored" in n for n in kernels["notes"]), kernels["notes"]
    if raw.get("activation_offloading"):
        assert any("activation_offloading is on" in n for n in kernels["notes"]), kernels["notes"]


def test_the_vision_example_packs_images_and_text_with_only_the_line(tmp_path):
    """Axolotl's Qwen3.5 vision example (`processor_type: AutoProcessor`, `skip_prepare_dataset`,
    `sample_packing: false`: Axolotl cannot pack this data) with the plugin line: several image+text
    samples per static row, each sample processed by Axolotl's own multimodal collator, the row's
    images and vision tokens in the report. (Exactness against each sample alone:
    tests/test_multimodal_packing.py, with Axolotl's processing too.)"""
    path, changed = with_the_line(VISION, tmp_path, sequence_len=512)
    log = train(path)
    r = report(tmp_path / "out")
    settings, packing = r["settings"], r["packing"]
    assert settings["multimodal"] and settings["rows"] == "fastqwen"
    assert any(d.startswith("processor_type + skip_prepare_dataset: image+text samples packed by the plugin")
               for d in settings["decisions"])
    vision = packing["multimodal"]
    assert vision["images"] > 40 and vision["vision_tokens"] > vision["images"] and vision["images_per_row"] > 2
    epoch = packing["epochs"][0]
    assert epoch["samples"] == 48 and epoch["bins"] < 48 / 3  # several samples a row
    assert r["kernels"]["batch_shapes"]["train"] == [[1, 512]] and r["kernels"]["boundary_sources"] == ["collator"]
    losses = train_losses(log)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert "image+text samples processed once for their lengths" in log
    shown = subprocess.run([sys.executable, "-m", "axolotl_fastqwen", "report", str(tmp_path / "out")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert f"image+text: {vision['images']} images, {vision['vision_tokens']} vision tokens" in shown.stdout


def test_with_packing_off_the_vision_example_runs_axolotls_one_sample_batches(tmp_path):
    """`fastqwen_packing: false`: Axolotl's own multimodal batches, one padded sample a step, run by
    the patched model unchanged (a new shape each step)."""
    path, _ = with_the_line(VISION, tmp_path, sequence_len=512, fastqwen_packing=False)
    train(path)
    r = report(tmp_path / "out")
    assert not r["settings"]["multimodal"] and r["packing"] == {"active": False, "rows": "padded"}
    shapes = r["kernels"]["batch_shapes"]["train"]
    assert len(shapes) > 1 and all(s[0] == 1 and s[1] < 512 for s in shapes), shapes


def test_an_image_text_sample_longer_than_the_budget_is_named(tmp_path):
    path, _ = with_the_line(VISION, tmp_path, sequence_len=64)
    out = fails("train", str(path), "--launcher", "python")
    assert "image+text samples are longer than the token budget of 64: dataset index" in out
    assert "An image is never split" in out


def test_eval_sample_packing_and_evals_are_packed_by_the_plugin(tmp_path):
    """The Qwen3-Next example evaluates (`val_set_size: 0.1`, `evals_per_epoch`): with
    `eval_sample_packing: true` too, evaluation rows come from the plugin's packer. (LoRA, not QLoRA:
    bitsandbytes' CPU 4-bit kernel for inference needs widths the tiny model does not have.)"""
    path, _ = with_the_line("qwen3-next-80b-a3b-qlora.yaml", tmp_path, eval_sample_packing=True, eval_steps=3,
                            evals_per_epoch=None, load_in_4bit=False, adapter="lora")
    log = train(path)
    r = report(tmp_path / "out")
    assert r["settings"]["pack_eval"] and r["kernels"]["batch_shapes"]["eval"] == [[1, 4096]]
    assert "eval_loss" in log


@pytest.mark.parametrize(("keys", "message"), [
    ({"liger_rms_norm": True, "plugins": ["axolotl.integrations.liger.LigerPlugin"]},
     "`liger_rms_norm: true` run Triton kernels, which need a CUDA GPU; this run trains on cpu"),
    ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]},
     "Please install Axolotl's fork of cut_cross_entropy"),
    ({"tf32": True}, "--tf32 requires Ampere or a newer GPU"),
])
def test_what_a_cpu_user_gets_for_a_gpu_only_key(keys, message, tmp_path):
    """Keys `on_cpu` changes: on a CPU each fails with a message that names it (ours for Liger, before
    the model loads; Axolotl's or HF's for the others, with or without the plugin)."""
    plugins = keys.pop("plugins", [])
    path, _ = with_the_line("27b-qlora.yaml", tmp_path, **keys)
    cfg = yaml.safe_load(path.read_text())
    cfg["plugins"] = [*plugins, PLUGIN]
    path.write_text(yaml.safe_dump(cfg))
    out = fails("train", str(path), "--launcher", "python")
    assert message in out, out[-3000:]


@pytest.mark.parametrize("expert_lora", [False, True], ids=["example", "with-lora_target_parameters"])
def test_the_moe_qlora_example_trains_its_4bit_experts_on_the_plugins_experts(expert_lora, tmp_path):
    """`quantize_moe_experts: true` as on a GPU: the routed experts' stacks in 4 bits (the test plugin
    `quantized_experts_on_cpu.py` quantizes them as Axolotl's loader does on a GPU). With the line they run
    the plugin's `fastqwen_grouped`, the shared expert in its sum, and with `lora_target_parameters` peft's
    expert LoRA factored; before, such stacks silently kept transformers' experts. (Exactness against
    transformers on the same 4-bit base: tests/test_quantized_experts.py.)"""
    extra = {"lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if expert_lora else {}
    path, changed = with_the_line("35b-a3b-moe-qlora.yaml", tmp_path, **extra)
    assert "quantize_moe_experts" in changed  # needs CUDA at load; the test plugin does its work instead
    cfg = yaml.safe_load(path.read_text())
    cfg["plugins"] = ["quantized_experts_on_cpu.QuantizedExpertsOnCpu", *cfg["plugins"]]
    path.write_text(yaml.safe_dump(cfg))
    log = train(path, env_extra={"PYTHONPATH": str(Path(__file__).resolve().parent)})
    kernels = report(tmp_path / "out")["kernels"]
    experts, notes = kernels["experts"], kernels["notes"]
    assert experts["implementation"] == "fastqwen_grouped", experts
    assert experts["stacks"].startswith("gate_up_proj and down_proj stored as bitsandbytes 4-bit nf4"), experts
    assert "added in the routed rows' sum" in experts["shared_expert"]
    assert any("runs factored" in n for n in notes) is expert_lora, notes
    losses = train_losses(log)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
