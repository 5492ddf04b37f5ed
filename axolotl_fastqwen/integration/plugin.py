"""The Axolotl plugin: one YAML line turns on the fused layers, the packer and the memory levers.

Axolotl 0.21 registers every installed `axolotl.plugins` entry point on every run, named in the
YAML or not, so each hook first asks whether this run named the plugin; if not, it does nothing.
Hooks used: `register` (at config load, before Axolotl validates it: the YAML is read once into
`Settings`, and the keys whose job the plugin takes over are turned off), `get_input_args` (our
keys), `pre_model_load` (fail early on an unsupported model or kernel mode), `post_model_load`
(patch the final model, adapters included), `get_collator_cls_and_kwargs` (the packer's collator),
`post_trainer_create` (the packer's batch sampler, exact step counts, the report, the trainer
callbacks).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from axolotl.integrations.base import BasePlugin

from .. import registry
from ..devices import training_device
from ..families.base import UnsupportedModelError
from ..kernel_choice import KernelUnavailableError
from ..patching.patch import patch_model
from ..report_text import REPORT_FILE
from . import axolotl_options
from .bare_name import BARE_NAME, alias_bare_name
from .callbacks import FitCheckpointing, KeepReport
from .settings import ConfigError, Environment, Settings, resolve, show_config_errors_without_traceback

LOG = logging.getLogger("axolotl_fastqwen")

NAMES = frozenset({BARE_NAME, "axolotl_fastqwen.FastQwenPlugin", "axolotl_fastqwen:FastQwenPlugin"})


def named_in(cfg) -> bool:
    return any(str(name) in NAMES for name in (cfg.get("plugins") or []))


class FastQwenPlugin(BasePlugin):
    def __init__(self):
        super().__init__()
        self.active = False
        self.settings: Settings | None = None
        self.report = None
        self.fit: FitCheckpointing | None = None
        self.vision: dict | None = None  # image+text data: the model's rope index and placeholder ids
        alias_bare_name()

    # ---- configuration ---------------------------------------------------------------------
    def register(self, cfg):
        self.active = named_in(cfg)
        if not self.active:
            ours = sorted(key for key in cfg if str(key).startswith("fastqwen_"))
            if ours:
                LOG.warning(
                    "axolotl_fastqwen is installed but not in `plugins:`, so %s are ignored. Add "
                    "`plugins: [axolotl_fastqwen.FastQwenPlugin]` to use them.",
                    ", ".join(ours),
                )
            return
        # our logger sits outside Axolotl's "axolotl" hierarchy: show our INFO lines as it shows its own
        LOG.setLevel(min(logging.getLogger("axolotl").getEffectiveLevel(), logging.INFO))
        show_config_errors_without_traceback()
        self.settings, edits = resolve(cfg, Environment.detect())
        check_model_type(self.settings)  # at config load: before Axolotl tokenizes anything
        for key, value in edits.items():
            cfg[key] = value
        for decision in self.settings.decisions:
            LOG.info("axolotl_fastqwen: %s", decision)

    def get_input_args(self):
        return "axolotl_fastqwen.integration.keys.FastQwenArgs" if self.active else None

    # ---- model -----------------------------------------------------------------------------
    def pre_model_load(self, cfg):
        if not self.active:
            return
        refuse_model_type(cfg.get("model_config_type"))  # derived by Axolotl after config load
        axolotl_options.check_device(self.settings, training_device().type)
        if self.settings.kernels == "require" and not torch.cuda.is_available():
            raise KernelUnavailableError(
                "fastqwen_kernels: require needs a CUDA GPU with flash-linear-attention; this machine has "
                "none. Use fastqwen_kernels: auto (PyTorch reference path on CPU)."
            )

    def post_model_load(self, cfg, model):
        if not self.active:
            return
        settings = self.settings
        if not settings.patch_layers:
            LOG.warning("axolotl_fastqwen: the model's layers stay stock under context parallelism (the load "
                        "report's decisions say why)")
            return
        self.report = patch_model(
            model,
            backend=settings.kernels,
            fused_cross_entropy=settings.fused_ce,
            device=training_device(),
            prefer=settings.kernel_preference,
            lean_activations=settings.lean_activations,
            fp8=settings.fp8,
            fp8_tokens=settings.token_budget,
            fp8_input_gradient=settings.fp8_input_gradient,
            mlp_chunk_tokens=settings.mlp_chunk_tokens,
            checkpoint_offload=settings.checkpoint_offload,
            fused_lora=settings.fused_lora,
            moe_cuda_graphs=settings.moe_cuda_graphs,
            log=False,
        )
        if settings.loss_owner:
            self.report.fused_cross_entropy = f"delegated to Axolotl's {settings.loss_owner}"
        self.report.kernels.notes.extend(axolotl_options.notes(settings, self.report))
        self.report.kernels.notes.extend(settings.notes)
        if settings.multimodal:
            self.vision = vision_of(model)
        LOG.info("%s", self.report.format())

    # ---- data ------------------------------------------------------------------------------
    def get_collator_cls_and_kwargs(self, cfg, is_eval=False):
        settings = self.settings
        if not (self.active and settings.packer and (settings.pack_eval or not is_eval)) or settings.multimodal:
            return None  # image+text: Axolotl builds its multimodal collator; the packer wraps it (post_trainer_create)
        from .trainer_packing import AxolotlPackedCollator

        return AxolotlPackedCollator, {"token_budget": settings.token_budget}

    def post_trainer_create(self, cfg, trainer):
        if not self.active:
            return
        if self.settings.multimodal:
            from .trainer_packing import install_multimodal_packer

            packing_report = install_multimodal_packer(trainer, self.settings, **self.vision)
        elif self.settings.packer:
            from .trainer_packing import install_packed_sampler

            packing_report = install_packed_sampler(trainer, self.settings)
        else:
            packing_report = {"active": False, "rows": self.settings.rows}
        self.fit = FitCheckpointing(self.settings.checkpointing_memory) if self.settings.checkpointing == "auto" else None

        def write() -> None:
            self._write_report(trainer, packing_report)

        write()
        if self.fit is not None:
            trainer.add_callback(self.fit)
        trainer.add_callback(KeepReport(self.report.context if self.report else None, write))

    def _write_report(self, trainer, packing_report) -> None:
        if not trainer.is_world_process_zero():
            return
        fitter = self.fit.fitter if self.fit is not None else None
        checkpointing = fitter.to_dict() if fitter is not None else {"mode": self.settings.checkpointing}
        data = {"plugin": "axolotl_fastqwen", "settings": self.settings.to_dict(),
                "kernels": self.report.to_dict() if self.report else None,
                "packing": packing_report, "checkpointing": checkpointing}
        out = Path(self.settings.output_dir or trainer.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
        LOG.info("axolotl_fastqwen: report written to %s", out / REPORT_FILE)


def vision_of(model) -> dict:
    """What packing image+text samples needs of the model: its own mRoPE index and placeholder ids.
    A text-only checkpoint has none: an error that says which checkpoint to load."""
    from ..packing.multimodal import rope_index_of

    rope_index = rope_index_of(model)
    config = model.config
    vision = getattr(config, "vision_config", None)
    return {"rope_index": rope_index, "image_token_id": config.image_token_id,
            "video_token_id": getattr(config, "video_token_id", None),
            "merge_size": getattr(vision, "spatial_merge_size", 2)}


def supported_model_types() -> set[str]:
    return {t for family in registry.families() for t in family.model_types}


def refuse_model_type(model_type: str | None) -> None:
    supported = supported_model_types()
    if model_type and model_type not in supported:
        raise UnsupportedModelError(
            f"axolotl_fastqwen supports model types {sorted(supported)}; this config loads "
            f"{model_type!r}. Remove axolotl_fastqwen from `plugins:` for this model."
        )


def check_model_type(settings: Settings) -> None:
    """Refuse an unsupported model from its config.json, at config load. A config that cannot be
    read here (not downloaded yet, remote code) is checked again at model load."""
    if not settings.model_source:
        return
    supported_model_types()  # first: loads the extensions, which may register their configs
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(settings.model_source, trust_remote_code=settings.trust_remote_code,
                                            revision=settings.revision)
    except Exception as exc:  # noqa: BLE001 - any failure to read it defers the check
        LOG.debug("axolotl_fastqwen: model config of %s not readable at config load (%s)", settings.model_source, exc)
        return
    try:
        refuse_model_type(getattr(config, "model_type", None))
    except UnsupportedModelError as err:
        raise ConfigError(f"`base_model: {settings.model_source}`", str(err)) from None
