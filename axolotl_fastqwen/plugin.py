"""The Axolotl plugin: one YAML line turns on the fused layers and the packer.

Axolotl 0.21 registers every installed `axolotl.plugins` entry point on every run, named in the
YAML or not, so each hook first asks whether this run named the plugin; if not, it does nothing.
Hooks used: `register` (named or not), `get_input_args` (our config keys), `pre_model_load`
(fail early on an unsupported model or kernel mode), `post_model_load` (patch the final model,
adapters included), `get_collator_cls_and_kwargs` (the packer's collator),
`post_trainer_create` (the packer's batch sampler, exact step counts, the report, and the
trainer callbacks: `fastqwen_checkpointing: auto`, the report re-written at the end).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from . import coexistence, registry
from .args import lean_activations_setting, token_budget
from .axolotl_compat import BARE_NAME, alias_bare_name
from .devices import training_device
from .families.base import UnsupportedModelError
from .kernels import KernelUnavailableError
from .patching import patch_model
from .report import REPORT_FILE

LOG = logging.getLogger("axolotl_fastqwen")

NAMES = frozenset({BARE_NAME, "axolotl_fastqwen.FastQwenPlugin", "axolotl_fastqwen:FastQwenPlugin"})


def named_in(cfg) -> bool:
    return any(str(name) in NAMES for name in (cfg.get("plugins") or []))


class FastQwenPlugin(BasePlugin):
    def __init__(self):
        super().__init__()
        self.active = False
        self.report = None
        self.checkpointing = None  # a CheckpointFitter under fastqwen_checkpointing: auto, once training starts
        alias_bare_name()

    # ---- configuration ---------------------------------------------------------------------
    def register(self, cfg):
        self.active = named_in(cfg)
        if self.active:
            # our logger sits outside Axolotl's "axolotl" hierarchy: show our INFO lines as it shows its own
            LOG.setLevel(min(logging.getLogger("axolotl").getEffectiveLevel(), logging.INFO))
            check_model_type(cfg)  # at config load: before Axolotl tokenizes anything
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
        refuse_model_type(cfg.get("model_config_type"))
        coexistence.check_device(cfg, training_device().type)
        if cfg.get("fastqwen_kernels") == "require" and not torch.cuda.is_available():
            raise KernelUnavailableError(
                "fastqwen_kernels: require needs a CUDA GPU with flash-linear-attention; this machine has "
                "none. Use fastqwen_kernels: auto (PyTorch reference path on CPU)."
            )

    def post_model_load(self, cfg, model):
        if not self.active:
            return
        fused_ce = bool(cfg.get("fastqwen_fused_ce", True))
        lean, lean_note = lean_activations_setting(cfg)
        self.report = patch_model(
            model,
            backend=cfg.get("fastqwen_kernels") or "auto",
            fused_cross_entropy=fused_ce,
            device=training_device(),
            prefer=cfg.get("fastqwen_kernel_preference") or None,
            lean_activations=lean,
            log=False,
        )
        owner = coexistence.loss_owner(cfg)
        if owner:
            self.report.fused_cross_entropy = f"delegated to Axolotl's {owner}"
        self.report.kernels.notes.extend(coexistence.notes(cfg, self.report))
        if lean_note:
            self.report.kernels.notes.append(lean_note)
        LOG.info("%s", self.report.format())

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
        if cfg.get("fastqwen_checkpointing") == "auto":
            trainer.add_callback(_FitCheckpointing(self, cfg))
        trainer.add_callback(_ReportOnTrainEnd(self, cfg, trainer, packing_report))

    def _write_report(self, cfg, trainer, packing_report) -> None:
        if not trainer.is_world_process_zero():
            return
        checkpointing = (self.checkpointing.to_dict() if self.checkpointing is not None
                         else {"mode": cfg.get("fastqwen_checkpointing") or "full"})
        data = {"plugin": "axolotl_fastqwen", "kernels": self.report.to_dict() if self.report else None,
                "packing": packing_report or {"active": False}, "checkpointing": checkpointing}
        out = Path(cfg.get("output_dir") or trainer.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
        LOG.info("axolotl_fastqwen: report written to %s", out / REPORT_FILE)


def supported_model_types() -> set[str]:
    return {t for family in registry.families() for t in family.model_types}


def refuse_model_type(model_type: str | None) -> None:
    supported = supported_model_types()
    if model_type and model_type not in supported:
        raise UnsupportedModelError(
            f"axolotl_fastqwen supports model types {sorted(supported)}; this config loads "
            f"{model_type!r}. Remove axolotl_fastqwen from `plugins:` for this model."
        )


def check_model_type(cfg) -> None:
    """Refuse an unsupported model from its config.json, at config load. A config that cannot be
    read here (not downloaded yet, remote code) is checked again at model load."""
    source = cfg.get("base_model_config") or cfg.get("base_model")
    if not source:
        return
    supported_model_types()  # first: loads the extensions, which may register their configs
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            source, trust_remote_code=bool(cfg.get("trust_remote_code")), revision=cfg.get("revision_of_model")
        )
    except Exception as exc:  # noqa: BLE001 - any failure to read it defers the check
        LOG.debug("axolotl_fastqwen: model config of %s not readable at config load (%s)", source, exc)
        return
    refuse_model_type(getattr(config, "model_type", None))


def _packing(cfg) -> bool:
    return cfg.get("fastqwen_packing", True) is not False


class _FitCheckpointing(TrainerCallback):
    """`fastqwen_checkpointing: auto` (checkpointing.py) around every optimizer step. Built at train
    begin: the Trainer turns gradient checkpointing on just before it."""

    def __init__(self, plugin, cfg):
        self.plugin, self.cfg = plugin, cfg

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from .checkpointing import DEFAULT_CHECKPOINTING_MEMORY, CheckpointFitter, memory_of

        self.plugin.checkpointing = CheckpointFitter(model, memory_of(training_device()),
                                                     fraction=float(self.cfg.get("fastqwen_checkpointing_memory")
                                                                    or DEFAULT_CHECKPOINTING_MEMORY))
        LOG.info("axolotl_fastqwen: fastqwen_checkpointing: auto: %s", self.plugin.checkpointing.summary())

    def on_step_begin(self, args, state, control, **kwargs):
        if self.plugin.checkpointing is not None:
            self.plugin.checkpointing.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self.plugin.checkpointing is not None:
            self.plugin.checkpointing.step_end()

    def on_train_end(self, args, state, control, **kwargs):
        if self.plugin.checkpointing is not None:
            LOG.info("axolotl_fastqwen: checkpointing: %s", self.plugin.checkpointing.summary())
            self.plugin.checkpointing.restore()


class _ReportOnTrainEnd(TrainerCallback):
    """Warns at each log step when steps without a trainable token occurred; re-writes the report at
    the end with what the run saw (where boundaries came from, kernels handed to the reference, ...)."""

    def __init__(self, plugin, cfg, trainer, packing_report):
        self.plugin, self.cfg, self.trainer, self.packing_report = plugin, cfg, trainer, packing_report

    def on_log(self, args, state, control, **kwargs):
        if self.plugin.report is not None and self.plugin.report.context is not None:
            self.plugin.report.context.warn_empty_forwards()

    def on_train_end(self, args, state, control, **kwargs):
        self.on_log(args, state, control)
        self.plugin._write_report(self.cfg, self.trainer, self.packing_report)
