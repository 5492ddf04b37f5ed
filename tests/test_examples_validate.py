"""Every ``examples/*.yml`` passes Axolotl 0.21's own config validation, offline.

The chain is the one ``axolotl train`` runs in ``load_cfg`` (axolotl/cli/config.py):
``prepare_plugins`` -> ``validate_config`` (the pydantic schema ``AxolotlInputConfig`` plus the
plugin's merged keys, all validators, with GPU capabilities) -> ``normalize_config`` (reads the
model's config.json: model_config_type, multimodal loading, dtype, the DeepSpeed JSON) ->
``normalize_cfg_datasets``. Left out of ``load_cfg``: telemetry, the stdout tee into debug.log
and the optimizer / W&B / MLflow environment setup, which only have side effects.

Real-model examples cannot reach the hub here. ``validate_config`` runs on the YAML as written,
with the capabilities of the hardware their header names (H200: sm_90, bf16, fp8; 8 GPUs for the
FSDP / DeepSpeed ones). ``normalize_config`` needs the checkpoint's config.json, so it runs
against a local stand-in config of the SAME model_type (tiny, from tiny_assets; ``qwen3_5`` /
``qwen3_5_moe`` are the composite vision-language configs the real checkpoints have): Axolotl's
model-type-dependent handling runs for real, the model sizes are not checked.
CPU examples run the same chain with this machine's own capabilities, against the tiny
checkpoint config their ``base_model:`` names.

The plugin is imported as part of the chain: an import failure fails every example (a shipped
example whose plugin does not load is a broken example).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import tiny_assets as ta  # noqa: E402

pytest.importorskip("axolotl")
pytestmark = pytest.mark.axolotl

REPO = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yml"))
PLUGIN = "axolotl_fastqwen.FastQwenPlugin"

# base_model -> (stand-in config builder, the model_type Axolotl must see)
STAND_INS = {
    ".assets/qwen3_5": (lambda: ta.tiny_config("qwen3_5"), "qwen3_5_text"),
    ".assets/qwen3_5_moe": (lambda: ta.tiny_config("qwen3_5_moe"), "qwen3_5_moe_text"),
    ".assets/qwen3_next": (lambda: ta.tiny_config("qwen3_next"), "qwen3_next"),
    "Qwen/Qwen3.5-27B": (lambda: ta.tiny_vl_config("qwen3_5"), "qwen3_5"),
    "Qwen/Qwen3.5-35B-A3B": (lambda: ta.tiny_vl_config("qwen3_5_moe"), "qwen3_5_moe"),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (lambda: ta.tiny_config("qwen3_next"), "qwen3_next"),
}
# model_type -> the tiny model whose module names the LoRA targets / FSDP wrap class must hit
TINY_MODEL_FOR = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_vl",
    "qwen3_5_moe": "qwen3_5_moe_vl",
}
H200 = {"bf16": True, "fp8": True, "tf32": True, "n_node": 1, "compute_capability": "sm_90"}


def _read(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _is_cpu_example(path: Path) -> bool:
    return path.name.startswith("tiny-")


def _n_gpu(raw: dict) -> int:
    return 8 if raw.get("fsdp_config") or raw.get("deepspeed") else 1


_PRECISION_KNOBS = (
    ("backends", torch.backends),
    ("cuda.matmul", torch.backends.cuda.matmul),
    ("cudnn", torch.backends.cudnn),
    ("cudnn.conv", torch.backends.cudnn.conv),
    ("cudnn.rnn", torch.backends.cudnn.rnn),
    ("mkldnn", torch.backends.mkldnn),
    ("mkldnn.matmul", torch.backends.mkldnn.matmul),
    ("mkldnn.conv", torch.backends.mkldnn.conv),
    ("mkldnn.rnn", torch.backends.mkldnn.rnn),
)


@pytest.fixture
def axolotl_sandbox(monkeypatch):
    """Undo what Axolotl's config chain changes process-wide, so later tests see a clean process:
    the PluginManager singleton, os.environ, and the fp32 matmul precision (``tf32: true`` makes
    normalize_config switch even CPU matmuls to TF32)."""
    from axolotl.integrations.base import PluginManager

    monkeypatch.chdir(REPO)  # deepspeed: paths are relative to the repository root
    saved_env = dict(os.environ)
    saved_manager = PluginManager._instance
    saved_precision = torch.get_float32_matmul_precision()
    saved_knobs = [knob.fp32_precision for _, knob in _PRECISION_KNOBS]
    PluginManager._instance = None
    try:
        yield
    finally:
        PluginManager._instance = saved_manager
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_float32_matmul_precision(saved_precision)
        for (_, knob), value in zip(_PRECISION_KNOBS, saved_knobs, strict=True):
            knob.fp32_precision = value


def _validate(raw: dict, tmp_path: Path):
    """Axolotl's load_cfg chain (see the module docstring); returns the normalized cfg."""
    from axolotl.cli.config import gpu_capabilities
    from axolotl.utils.config import (
        normalize_cfg_datasets,
        normalize_config,
        prepare_plugins,
        validate_config,
    )
    from axolotl.utils.dict import DictDefault

    raw = copy.deepcopy(raw)
    if str(raw["base_model"]).startswith(".assets/"):
        capabilities, env_capabilities = gpu_capabilities()  # what `axolotl train` sees here
    else:
        capabilities = dict(H200, n_gpu=_n_gpu(raw))
        env_capabilities = {"torch_version": torch.__version__.split("+")[0]}
    raw["output_dir"] = str(tmp_path / "out")
    cfg = DictDefault(raw)
    prepare_plugins(cfg)
    cfg = validate_config(cfg, capabilities=capabilities, env_capabilities=env_capabilities)

    make_config, _ = STAND_INS[raw["base_model"]]
    stand_in = tmp_path / "stand-in-config"
    make_config().save_pretrained(stand_in)
    cfg.base_model_config = str(stand_in)
    normalize_config(cfg)
    normalize_cfg_datasets(cfg)
    return cfg


def test_the_expected_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert names >= {
        "tiny-qwen3_5-cpu.yml",
        "tiny-qwen3_next-cpu.yml",
        "tiny-qwen3_5_moe-cpu.yml",
        "qwen3_5-27b-lora.yml",
        "qwen3_5-27b-qlora.yml",
        "qwen3_5-27b-fft.yml",
        "qwen3_5-35b-a3b-lora.yml",
        "qwen3_next-80b-a3b-lora.yml",
        "qwen3_5-27b-lora-fsdp2.yml",
        "qwen3_5-27b-lora-deepspeed-zero2.yml",
        "qwen3_5-27b-fft-deepspeed-zero3.yml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_follows_the_house_rules(path):
    """One plugin line and nothing else of the plugin's (`sample_packing: true` as users write it, the
    packer's budget its default), and a header that says what the file is for and on what hardware."""
    text = path.read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    header = text.split("\nplugins:")[0]
    assert header.startswith("# ") and "Hardware:" in header
    assert "The one line that enables the plugin" in header
    assert raw["plugins"] == [PLUGIN]
    assert raw["sample_packing"] is True
    assert "eval_sample_packing" not in raw
    assert not [key for key in raw if key.startswith("fastqwen_")]
    budget = raw["sequence_len"] * raw["micro_batch_size"]  # the packer's default budget
    assert budget % 64 == 0
    assert raw["base_model"] in STAND_INS
    if _is_cpu_example(path):
        family = raw["base_model"].split("/")[-1]
        assert raw["base_model"] == f".assets/{family}"
        assert ta.asset_paths(".assets")[family] == Path(raw["base_model"])
        assert raw["datasets"][0]["path"] == ".assets/data/chat.jsonl"
        assert (raw["sequence_len"], raw["micro_batch_size"], raw["max_steps"]) == (512, 2, 8)
        assert budget == 1024 and raw["lora_r"] == 8
        assert raw["output_dir"] == f"./outputs/{path.stem}"
        assert raw["dataset_prepared_path"].startswith("./outputs/")
        assert raw["bf16"] is False and raw["flash_attention"] is False
        assert not any(raw[k] for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"))
    else:
        assert budget == 16384
        assert raw["bf16"] is True
        ds = raw.get("deepspeed")
        if ds:
            assert (REPO / ds).is_file()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_axolotl_validation(path, tmp_path, axolotl_sandbox):
    raw = _read(path)
    cfg = _validate(raw, tmp_path)
    _, model_type = STAND_INS[raw["base_model"]]
    assert cfg.model_config_type == model_type
    assert cfg.sample_packing is False  # the plugin's packer took it over at config load
    assert cfg.sequence_len == raw["sequence_len"]
    # Qwen3.5 checkpoints are vision-language: Axolotl loads *ForConditionalGeneration for them.
    assert bool(cfg.is_multimodal) == (model_type in ("qwen3_5", "qwen3_5_moe"))
    if raw.get("adapter"):
        assert cfg.adapter == raw["adapter"] and cfg.lora_r == raw["lora_r"]
        assert list(cfg.lora_target_modules) == raw["lora_target_modules"]
        if _is_cpu_example(path):  # Axolotl's Triton LoRA kernels need CUDA
            assert not (cfg.lora_mlp_kernel or cfg.lora_qkv_kernel or cfg.lora_o_kernel)
    if raw.get("load_in_4bit"):
        assert cfg.load_in_4bit is True and cfg.adapter == "qlora"
    if raw.get("fsdp_config"):
        assert cfg.fsdp_config.fsdp_version == 2
    if raw.get("deepspeed"):
        stage = cfg.deepspeed["zero_optimization"]["stage"]  # normalize_config loaded the JSON
        assert stage == (3 if "zero3" in path.name else 2)
    if _is_cpu_example(path):
        assert cfg.device == "cpu" and cfg.torch_dtype == torch.float32
    else:
        assert cfg.torch_dtype == torch.bfloat16
    assert cfg.fastqwen_kernels == "auto"  # the plugin's keys are in Axolotl's schema


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if _read(p).get("adapter")], ids=lambda p: p.name
)
def test_lora_targets_hit_the_real_module_names(path):
    """PEFT only finds a misspelt target at model load on the GPU; check the names on the tiny
    model of the same architecture now, linear-attention projections included. Also: PEFT must
    not have rewritten a name into LoRA on the routed experts' 3D parameters (it does that to
    gate/up/down_proj for qwen3_next, turning the adapter into billions of parameters)."""
    from peft import LoraConfig, get_peft_model

    raw = _read(path)
    _, model_type = STAND_INS[raw["base_model"]]
    model = ta.build_tiny_model(TINY_MODEL_FOR[model_type])
    targets = raw["lora_target_modules"]
    peft_model = get_peft_model(model, LoraConfig(r=raw["lora_r"], target_modules=targets))
    assert not peft_model.peft_config["default"].target_parameters
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    for target in targets:
        assert any(name == target or name.endswith("." + target) for name in adapted), target
    assert any(".linear_attn." in name for name in adapted)
    assert not any(".visual." in name for name in adapted)  # the vision tower is left alone


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if _read(p).get("fsdp_config")], ids=lambda p: p.name
)
def test_fsdp_wraps_the_decoder_layer_class(path):
    raw = _read(path)
    _, model_type = STAND_INS[raw["base_model"]]
    model = ta.build_tiny_model(TINY_MODEL_FOR[model_type])
    wrap = raw["fsdp_config"]["transformer_layer_cls_to_wrap"]
    layer_classes = {type(layer).__name__ for layer in model.get_decoder().layers}
    assert layer_classes == {wrap}


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if _read(p).get("unfrozen_parameters")], ids=lambda p: p.name
)
def test_unfrozen_parameters_train_the_language_model_only(path):
    """Axolotl escapes every '.' in these patterns; a pattern written as a regex ('\\.', '.*')
    silently matches nothing and freezes the whole model."""
    from axolotl.utils.freeze import LayerNamePattern

    patterns = [LayerNamePattern(p) for p in _read(path)["unfrozen_parameters"]]
    model = ta.build_tiny_model("qwen3_5_vl")  # the composite model Axolotl loads for Qwen3.5
    for name, _ in model.named_parameters():
        trainable = any(p.match(name) for p in patterns)
        assert trainable == (not name.startswith("model.visual.")), name


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw["fsdp_config"].update(fsdp_version=1), "FSDP1"),
        (lambda raw: raw["fsdp_config"].update(sharding_strategy="FULL_SHARD"), "FSDP1-only"),
        (lambda raw: raw.update(lora_r="sixteen"), "lora_r"),
    ],
    ids=["fsdp1", "fsdp1-key", "bad-type"],
)
def test_validation_rejects_a_broken_example(mutate, message, tmp_path, axolotl_sandbox):
    """Control: the chain above really runs Axolotl's validators (it can say no)."""
    raw = _read(EXAMPLES_DIR / "qwen3_5-27b-lora-fsdp2.yml")
    mutate(raw)
    with pytest.raises(Exception, match=message):
        _validate(raw, tmp_path)


@pytest.mark.parametrize(
    "change",
    [{"fastqwen_token_budget": 1000}, {"fastqwen_kernels": "fast"}, {"fastqwen_pakcing": False}],
    ids=["budget-off-grid", "bad-kernels", "misspelt-key"],
)
def test_plugin_keys_are_validated(change, tmp_path, axolotl_sandbox):
    raw = _read(EXAMPLES_DIR / "qwen3_5-27b-lora.yml")
    raw.update(change)
    with pytest.raises(Exception, match="|".join(change)):
        _validate(raw, tmp_path)
