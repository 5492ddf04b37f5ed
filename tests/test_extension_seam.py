"""The pluggy seam, proven from outside: an installed extension adds a family and a kernel backend.

The extension is a real package (its own pyproject.toml and entry point in the group
`axolotl_fastqwen.extensions`), installed with uv into a folder of its own. It defines a new hybrid
family, `toy_hybrid` (its own config, decoder, Gated DeltaNet and attention classes, registered with
transformers' Auto classes), and a gated-RMSNorm backend that outranks the PyTorch reference on
any device. A real `axolotl train` of a tiny toy_hybrid checkpoint then runs with our plugin: the
report must name the extension's family and its kernel, and the model must match each sequence
run alone through its own (stock) layers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytest.importorskip("axolotl")
pytestmark = [pytest.mark.axolotl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent

PYPROJECT = """
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "fastqwen-ext-demo"
version = "0.1.0"
requires-python = ">=3.12"

[project.entry-points."axolotl_fastqwen.extensions"]
toy_hybrid = "fastqwen_ext_demo.fastqwen_family"

[tool.setuptools]
packages = ["fastqwen_ext_demo"]
"""

MODELING = '''
"""toy_hybrid: a Qwen3.5-style hybrid with classes of its own (what a new family looks like to us)."""
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as base
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb  # noqa: F401 (the family's RoPE)


class ToyHybridConfig(Qwen3_5TextConfig):
    model_type = "toy_hybrid"


class ToyHybridGatedDeltaNet(base.Qwen3_5GatedDeltaNet):
    pass


class ToyHybridAttention(base.Qwen3_5Attention):
    pass


class ToyHybridDecoderLayer(base.Qwen3_5DecoderLayer):
    pass


class ToyHybridTextModel(base.Qwen3_5TextModel):
    config_class = ToyHybridConfig


class ToyHybridForCausalLM(base.Qwen3_5ForCausalLM):
    config_class = ToyHybridConfig

    def __init__(self, config):
        super().__init__(config)  # builds qwen3_5's modules; they become the toy family's own classes
        self.model.__class__ = ToyHybridTextModel
        for layer in self.model.layers:
            layer.__class__ = ToyHybridDecoderLayer
            for name, cls in (("linear_attn", ToyHybridGatedDeltaNet), ("self_attn", ToyHybridAttention)):
                if hasattr(layer, name):
                    getattr(layer, name).__class__ = cls


AutoConfig.register("toy_hybrid", ToyHybridConfig)
AutoModelForCausalLM.register(ToyHybridConfig, ToyHybridForCausalLM)
'''

FAMILY = '''
"""The extension's hook implementations: the toy_hybrid family and one kernel backend."""
import torch
import torch.nn.functional as F

from axolotl_fastqwen.families.base import Family
from axolotl_fastqwen.families.qwen3_5 import LORA_TARGETS, project_split
from axolotl_fastqwen.hookspecs import hookimpl
from axolotl_fastqwen.ops.backend import KernelBackend, always

from . import modeling  # noqa: F401 (registers the config and model with transformers)

FAMILY = Family(
    name="toy_hybrid",
    model_types=("toy_hybrid",),
    modeling_module="fastqwen_ext_demo.modeling",
    text_config="ToyHybridConfig",
    causal_lm="ToyHybridForCausalLM",
    gated_deltanet="ToyHybridGatedDeltaNet",
    attention="ToyHybridAttention",
    decoder="ToyHybridTextModel",
    project_gated_deltanet=project_split,
    lora_targets=LORA_TARGETS,
)


def gated_norm(x, z, weight, *, eps):
    """rmsnorm(x) * weight * silu(z), all in fp32 (the reference does the scaling in x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(z.float())
    return h.to(x.dtype)


@hookimpl
def fastqwen_families():
    return [FAMILY]


@hookimpl
def fastqwen_kernel_backends():
    return [KernelBackend("gated_rmsnorm", "toy-fp32-gated-norm", gated_norm, 10, always)]
'''


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """The extension package, built and installed by uv into a folder of its own."""
    root = tmp_path_factory.mktemp("extension")
    src = root / "src"
    (src / "fastqwen_ext_demo").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "fastqwen_ext_demo" / "__init__.py").write_text("")
    (src / "fastqwen_ext_demo" / "modeling.py").write_text(textwrap.dedent(MODELING))
    (src / "fastqwen_ext_demo" / "fastqwen_family.py").write_text(textwrap.dedent(FAMILY))
    site = root / "site"
    uv = Path(sys.executable).parent / "uv"
    done = subprocess.run([str(uv), "pip", "install", "-p", sys.executable, "--no-deps", "--target", str(site), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(site.glob("fastqwen_ext_demo-*.dist-info/entry_points.txt"))
    return site


def env(site: Path) -> dict:
    e = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "tools"), e.get("PYTHONPATH", "")])
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e['PATH']}"
    return e


CHECKPOINT = """
import sys, torch
from transformers import AutoTokenizer
from tiny_assets import tiny_config, build_tokenizer
from fastqwen_ext_demo.modeling import ToyHybridConfig, ToyHybridForCausalLM
out = sys.argv[1]
config = ToyHybridConfig(**tiny_config("qwen3_5").to_dict())
torch.manual_seed(0)
model = ToyHybridForCausalLM(config)
with torch.no_grad():  # norms and gates away from their constant defaults, as the tiny assets do
    for name, p in model.named_parameters():
        if "norm" in name or "A_log" in name or "dt_bias" in name:
            p.add_(0.1 * torch.randn_like(p))
model.save_pretrained(out)
AutoTokenizer.from_pretrained(sys.argv[2]).save_pretrained(out)
"""


def test_an_installed_extension_family_and_kernel_train_with_axolotl(extension, tmp_path):
    from tiny_assets import write_assets

    assets = write_assets(ROOT / ".assets")
    checkpoint = tmp_path / "toy_hybrid"
    made = subprocess.run([sys.executable, "-c", CHECKPOINT, str(checkpoint), str(assets["tokenizer"])],
                          env=env(extension), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "toy_hybrid"

    cfg = yaml.safe_load((ROOT / "examples" / "tiny-qwen3_5-cpu.yml").read_text())
    cfg.update(base_model=str(checkpoint), output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prep"),
               max_steps=3, eval_steps=3, save_strategy="no")
    cfg["datasets"][0]["path"] = str(assets["chat"])
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "axolotl.cli.main", "train", str(path), "--launcher", "python"],
                         cwd=ROOT, env=env(extension), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads((tmp_path / "out" / "fastqwen_report.json").read_text())["kernels"]
    assert report["family"] == "toy_hybrid" and report["model_class"] == "ToyHybridForCausalLM"
    assert report["layers_patched"] == {"gated_deltanet": 3, "attention": 1}
    assert report["ops"]["gated_rmsnorm"]["backend"] == "toy-fp32-gated-norm"
    assert report["boundary_sources"] == ["collator"]


PARITY = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from transformers import AutoModelForCausalLM
import fastqwen_ext_demo.fastqwen_family  # noqa: F401
from axolotl_fastqwen import patch_model
from axolotl_fastqwen.packing import PackedCollator
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(3, 400, (n,), generator=g) for n in (37, 1, 70, 20)]
with stock_torch_kernels("qwen3_5"), torch.no_grad():  # the toy classes run qwen3_5's stock code
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
report = patch_model(model)
batch = PackedCollator(256)([{"input_ids": s.tolist()} for s in seqs])
with torch.no_grad():
    packed = model(**batch).logits[0, :128]
err = float((packed - alone).norm() / alone.norm())
print("RESULT", report.family, report.backends()["gated_rmsnorm"], err)
"""


def test_the_extension_family_is_exact_against_its_own_stock_layers(extension, tmp_path):
    """fp32: the extension's kernel and our layers, packed, against its stock classes alone (1e-5)."""
    checkpoint = tmp_path / "toy_hybrid"
    from tiny_assets import write_assets

    assets = write_assets(ROOT / ".assets")
    made = subprocess.run([sys.executable, "-c", CHECKPOINT, str(checkpoint), str(assets["tokenizer"])],
                          env=env(extension), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", PARITY, str(checkpoint), str(extension)], env=env(extension),
                          capture_output=True, text=True, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    _, family, backend, err = line.split()
    assert (family, backend) == ("toy_hybrid", "toy-fp32-gated-norm")
    assert float(err) <= 1e-5, err
