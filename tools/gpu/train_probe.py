"""An Axolotl plugin that only measures: `plugins: [..., train_probe.TrainProbePlugin]` with
tools/gpu on PYTHONPATH (the driver's configs do this). It changes nothing in the run.

It writes ``$FQ_PROBE_OUT`` (default ``<output_dir>/train_probe.json``), every 10 steps and at the
end of training:

* ``phases``: seconds since ``$FQ_T0`` (the driver's clock just before it starts ``axolotl train``;
  else this process's start) at plugin registration, model load, trainer creation, train begin,
  the end of the first optimizer step (``first_step_end``: the wall time to first step) and train end;
* ``steps``: per optimizer step, its wall time (``torch.cuda.synchronize`` at each step end), the
  running ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (GiB), and what the step's
  micro-batches held: token slots, real (non-pad) tokens, trainable labels, sequences (counted
  from ``position_ids`` restarts on real tokens; row 0 of a packed image+text row's ``[4, B, T]``),
  images and merged vision tokens (``image_grid_thw``), counted on the batches as the Trainer got them;
* ``peak``: the process-wide peaks, ``mem_get_info`` at the end, device name and the versions and
  paths of the packages that were actually imported (carried wheels vs the image's).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

GIB = 1024**3
PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "datasets", "trl", "axolotl", "fla",
            "liger_kernel", "bitsandbytes", "causal_conv1d", "axolotl_fastqwen", "tokenizers", "numpy")


def _t0() -> float:
    if os.environ.get("FQ_T0"):
        return float(os.environ["FQ_T0"])
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        return time.time()


def _versions() -> dict:
    import importlib
    import sys
    from importlib import metadata

    out = {}
    for name in PACKAGES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - not installed / not importable here
                out[name] = None
                continue
        version = getattr(mod, "__version__", None)
        if version is None:
            try:
                version = metadata.version(name.replace("_", "-"))
            except Exception:  # noqa: BLE001
                version = "?"
        out[name] = {"version": str(version), "path": os.path.dirname(getattr(mod, "__file__", "") or "")}
    return out


class _Probe:
    def __init__(self):
        self.t0 = _t0()
        self.phases: dict[str, float] = {}
        self.steps: list[dict] = []
        self.logs: list[dict] = []
        self.out: Path | None = None
        self.pad_id: int | None = None
        self._acc = None
        self._last = None
        self.info: dict = {}

    def mark(self, phase: str) -> None:
        self.phases.setdefault(phase, round(time.time() - self.t0, 3))

    # ---- counting the batches --------------------------------------------------------------
    def count(self, inputs) -> None:
        import torch

        try:
            ids = inputs.get("input_ids")
            if ids is None:
                return
            real = ids != self.pad_id if self.pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
            labels = inputs.get("labels")
            pos = inputs.get("position_ids")
            if pos is not None and pos.dim() == 3:
                pos = pos[0]
            if pos is not None and pos.shape == ids.shape:
                seqs = ((pos == 0) & real).sum()
            else:
                seqs = (real.sum(-1) > 0).sum()
            trainable = (labels != -100).sum() if labels is not None else real.sum()
            grid = inputs.get("image_grid_thw")
            images = grid.shape[0] if grid is not None else 0
            vision = (grid.prod(-1).sum() // 4) if grid is not None else 0  # merged tokens (2x2 merge)
            vec = torch.stack([torch.tensor(ids.numel(), device=ids.device), real.sum(), trainable, seqs,
                               torch.tensor(images, device=ids.device),
                               torch.as_tensor(vision, device=ids.device)]).to(torch.long)
            self._acc = vec if self._acc is None else self._acc + vec
        except Exception as exc:  # noqa: BLE001 - a probe must never break the run
            self.info["count_error"] = repr(exc)

    def step_end(self, state) -> None:
        import torch

        now = time.time()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            now = time.time()
        counts = self._acc.tolist() if self._acc is not None else [None] * 6
        self._acc = None
        row = {
            "step": int(state.global_step),
            "t": round(now - self.t0, 4),
            "dt": round(now - self._last, 4) if self._last is not None else None,
            "slots": counts[0], "real_tokens": counts[1], "trainable": counts[2], "sequences": counts[3],
            "images": counts[4], "vision_tokens": counts[5],
        }
        if cuda:
            row["max_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            row["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
            row["alloc_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        self._last = now
        self.steps.append(row)
        if len(self.steps) == 1:
            self.mark("first_step_end")
        if len(self.steps) % 10 == 0:
            self.write()

    def write(self) -> None:
        if self.out is None:
            return
        import torch

        peak = {}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            peak = {
                "max_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
                "max_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
                "device_used_gib": round((total - free) / GIB, 3),
                "device_total_gib": round(total / GIB, 3),
                "device": torch.cuda.get_device_name(),
            }
        record = {"t0_unix": self.t0, "phases": self.phases, "peak": peak, "info": self.info,
                  "steps": self.steps, "logs": self.logs}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.out)


class _ProbeCallback(TrainerCallback):
    def __init__(self, probe: _Probe):
        self.probe = probe

    def on_train_begin(self, args, state, control, **kwargs):
        self.probe.mark("train_begin")
        self.probe._last = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.probe.step_end(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.probe.logs.append({"step": int(state.global_step), **{k: v for k, v in logs.items()
                                                                         if isinstance(v, (int, float, str))}})

    def on_train_end(self, args, state, control, **kwargs):
        self.probe.mark("train_end")
        self.probe.info["versions"] = _versions()
        self.probe.write()


class TrainProbePlugin(BasePlugin):
    """Measures wall time to the first step, per-step time, memory and batch contents."""

    def __init__(self):
        super().__init__()
        self.probe = _Probe()

    def register(self, cfg):
        self.probe.mark("plugin_register")

    def pre_model_load(self, cfg):
        self.probe.mark("pre_model_load")
        out = os.environ.get("FQ_PROBE_OUT") or str(Path(cfg.get("output_dir") or ".") / "train_probe.json")
        self.probe.out = Path(out)

    def post_model_load(self, cfg, model):
        self.probe.mark("post_model_load")

    def post_trainer_create(self, cfg, trainer):
        self.probe.mark("post_trainer_create")
        tok = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
        tok = getattr(tok, "tokenizer", tok)  # a multimodal run's processor holds the tokenizer
        pad = getattr(tok, "pad_token_id", None)
        self.probe.pad_id = int(pad) if pad is not None else None
        self.probe.info.update(pad_token_id=self.probe.pad_id, trainer_class=type(trainer).__name__,
                               collator=type(trainer.data_collator).__name__)
        original = trainer.training_step
        probe = self.probe

        def training_step(model, inputs, *args, **kwargs):
            probe.count(inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_ProbeCallback(self.probe)]
