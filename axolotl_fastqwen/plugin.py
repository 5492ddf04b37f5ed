"""The Axolotl plugin: one YAML line turns on the fused layers and the packer.

Axolotl 0.21 registers every installed `axolotl.plugins` entry point on every run, named in the
YAML or not, so each hook first asks whether this run named the plugin; if not, it does nothing.
Hooks used: `register` (named or not), `get_input_args` (our config keys), `pre_model_load`
(fail early on an unsupported model or kernel mode), `post_model_load` (patch the final model,
adapters included), `get_collator_cls_and_kwargs` (the packer's collator),
`post_trainer_create` (the packer's batch sampler, exact step counts, the report).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from axolotl.integrations.base import BasePlugin, PluginManager
from transformers import TrainerCallback

from .args import token_budget
from .families.base import UnsupportedModelError
from .kernels import KernelUnavailableError
from .families.base import unwrap
from .patching import patch_model

LOG = logging.getLogger("axolotl_fastqwen")

NAMES = frozenset({"axolotl_fastqwen", "axolotl_fastqwen.FastQwenPlugin", "axolotl_fastqwen:FastQwenPlugin"})
REPORT_FILE = "fastqwen_report.json"


def loss_forward_replaced(model) -> bool:
    """Whether something (Liger, Cut Cross-Entropy) replaced the loaded model class's forward, i.e.
    its code no longer lives in the file that defines the class. Checked on the class, the level
    at which those patches work; the instance may be wrapped (peft) or not yet patched by us."""
    import inspect

    cls = type(unwrap(model))
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    try:
        defined_in = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return True  # cannot tell: trust the config key, as before
    return code is None or os.path.realpath(code.co_filename) != os.path.realpath(defined_in or "")


def named_in(cfg) -> bool:
    return any(str(name) in NAMES for name in (cfg.get("plugins") or []))


class _BareNameAlias(BasePlugin):
    """Stands in the plugin table under the bare name `axolotl_fastqwen`.

    Axolotl splits a configured plugin name on its last dot to import `module.Class`, so the bare
    module name cannot be loaded; but it skips loading any name already in its table. The real
    plugin (registered through the entry point just before) puts this inert twin there; every hook
    of the twin is BasePlugin's no-op, so nothing runs twice.
    """


class FastQwenPlugin(BasePlugin):
    def __init__(self):
        super().__init__()
        self.active = False
        self.report = None
        manager = PluginManager._instance
        if manager is not None and "axolotl_fastqwen" not in manager.plugins:
            manager.plugins["axolotl_fastqwen"] = _BareNameAlias()

    # ---- configuration ---------------------------------------------------------------------
    def register(self, cfg):
        self.active = named_in(cfg)
        if self.active:
            # our logger sits outside Axolotl's "axolotl" hierarchy: show our INFO lines as it shows its own
            LOG.setLevel(min(logging.getLogger("axolotl").getEffectiveLevel(), logging.INFO))
        else:
            ours = sorted(key for key in cfg if str(key).startswith("fastqwen_"))
            if ours:
                LOG.warning(
                    "axolotl_fastqwen is installed but not in `plugins:`, so %s are ignored. Add "
                    "`plugins: [axolotl_fastqwen.FastQwenPlugin]` to use them.",
                    ", ".join(ours),
                )

    def get_input_args(self):
        return "axolotl_fastqwen.args.FastQwenArgs" if self.active else None

    # ---- model -----------------------------------------------------------------------------
    def pre_model_load(self, cfg):
        if not self.active:
            return
        from . import registry

        supported = {t for family in registry.families() for t in family.model_types}
        model_type = cfg.get("model_config_type")
        if model_type and model_type not in supported:
            raise UnsupportedModelError(
                f"axolotl_fastqwen supports model types {sorted(supported)}; this config loads "
                f"{model_type!r}. Remove axolotl_fastqwen from `plugins:` for this model."
            )
        if cfg.get("fastqwen_kernels") == "require" and not torch.cuda.is_available():
            raise KernelUnavailableError(
                "fastqwen_kernels: require needs a CUDA GPU with flash-linear-attention; this machine has "
                "none. Use fastqwen_kernels: auto (PyTorch reference path on CPU)."
            )

    def post_model_load(self, cfg, model):
        if not self.active:
            return
        fused_ce = bool(cfg.get("fastqwen_fused_ce", True))
        delegated = [k for k in ("cut_cross_entropy", "liger_fused_linear_cross_entropy") if cfg.get(k)]
        not_applied = None
        if delegated and not loss_forward_replaced(model):
            # e.g. Liger's Qwen3.5 patch replaces Qwen3_5ForCausalLM.forward only: on the
            # vision-language checkpoints (Qwen3_5ForConditionalGeneration) the key does nothing
            not_applied = (
                f"{delegated[0]} is set but left {type(unwrap(model)).__name__}.forward stock (logits "
                "materialised): our fused cross-entropy stays on"
            )
            LOG.warning("axolotl_fastqwen: %s", not_applied)
            delegated = []
        if delegated:
            fused_ce = False  # that plugin already fuses the loss; ours steps aside
        self.report = patch_model(
            model,
            backend=cfg.get("fastqwen_kernels") or "auto",
            fused_cross_entropy=fused_ce,
            device=_training_device(),
        )
        if delegated:
            self.report.fused_cross_entropy = f"delegated to Axolotl's {delegated[0]}"
        if not_applied:
            self.report.kernels.notes.append(not_applied)

    # ---- data ------------------------------------------------------------------------------
    def get_collator_cls_and_kwargs(self, cfg, is_eval=False):
        if not (self.active and _packing(cfg)):
            return None
        from .packing.axolotl import AxolotlPackedCollator

        return AxolotlPackedCollator, {"token_budget": token_budget(cfg)}

    def post_trainer_create(self, cfg, trainer):
        if not self.active:
            return
        if _packing(cfg):
            from .packing.axolotl import install_packed_sampler

            packing_report = install_packed_sampler(trainer, cfg)
        else:
            packing_report = None
        self._write_report(cfg, trainer, packing_report)
        trainer.add_callback(_ReportOnTrainEnd(self, cfg, trainer, packing_report))

    def _write_report(self, cfg, trainer, packing_report) -> None:
        if not trainer.is_world_process_zero():
            return
        data = {"plugin": "axolotl_fastqwen", "kernels": self.report.to_dict() if self.report else None,
                "packing": packing_report or {"active": False}}
        out = Path(cfg.get("output_dir") or trainer.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
        LOG.info("axolotl_fastqwen: report written to %s", out / REPORT_FILE)


def _packing(cfg) -> bool:
    return cfg.get("fastqwen_packing", True) is not False


def _training_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class _ReportOnTrainEnd(TrainerCallback):
    """Re-writes the report at the end with what the run saw (e.g. where boundaries came from)."""

    def __init__(self, plugin, cfg, trainer, packing_report):
        self.plugin, self.cfg, self.trainer, self.packing_report = plugin, cfg, trainer, packing_report

    def on_train_end(self, args, state, control, **kwargs):
        self.plugin._write_report(self.cfg, self.trainer, self.packing_report)
