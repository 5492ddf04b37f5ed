"""The YAML read once: every `fastqwen_*` key and every Axolotl key the plugin acts on, turned into
one typed `Settings` at config load, before Axolotl validates the config or tokenizes anything.

The user's intent is honoured where the plugin can honour it, and each such decision is written
down (`Settings.decisions`: the key, what became of it, why) for the log and the report:

* `sample_packing` / `eval_sample_packing` / `batch_flattening` / `group_by_length` mean "pack my
  data" (or "pad less"): the plugin's packer takes their place at the same tokens per step, and the
  keys are turned off in the config Axolotl goes on to validate.
* Where the packer cannot run (streaming or pretraining data, `rl`, reward models, context
  parallelism, curriculum order, samples tokenized only in the collator), it steps aside by itself:
  Axolotl's own rows, or padded batches, with the fused kernels still on.
* `attn_implementation: flash_attention_2/3` without the flash-attn package: the decoder's
  attention is the plugin's varlen kernel anyway, so the rest of the model runs `sdpa`.
* `fastqwen_checkpointing: auto` wherever gradient checkpointing is on and `auto` can run (one CUDA
  device, the packer's static rows, no FSDP / DeepSpeed / `torch_compile` / activation offloading);
  `full` elsewhere, with the reason. Lean activations likewise.

Only a contradiction between two explicit choices is refused (`fastqwen_packing: true` with
streaming data, `fastqwen_lean_activations: true` with FSDP, a misspelt key): `ConfigError`, one
short paragraph with the key, why, and the YAML lines to paste, printed without a traceback by
`axolotl train`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from ..ops import check_op_names
from ..ops.fp8_linear import MIN_CAPABILITY
from ..packing.planner import TOKEN_BUDGET_MULTIPLE, check_token_budget
from .keys import FastQwenArgs

# Axolotl's own speed options the plugin composes with, supersedes or leaves to do the job
# (integration/axolotl_options.py says which); read here so nothing else reads the config.
AXOLOTL_OPTIONS = ("liger_rms_norm", "liger_rms_norm_gated", "liger_glu_activation", "liger_layer_norm", "liger_rope",
                   "liger_cross_entropy", "liger_fused_linear_cross_entropy", "cut_cross_entropy", "lora_qkv_kernel",
                   "lora_o_kernel", "lora_mlp_kernel", "fused_attn_kernel", "use_scattermoe", "use_sonicmoe",
                   "use_kernels")
SHARDING_KEYS = ("fsdp", "fsdp_config", "deepspeed")
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")

# Keys under which the packer cannot run, and why. Each makes the plugin leave the rows to Axolotl
# (or to padded batches) unless `fastqwen_packing: true` insists, which is refused.
PACKER_BLOCKERS = {
    "pretraining_dataset": "streaming pretraining data: the packer needs every sample's length before the epoch",
    "streaming": "streaming datasets: the packer needs every sample's length before the epoch",
    "rl": "preference / RL trainers build their own batches (chosen and rejected together)",
    "reward_model": "reward-model training pairs its samples",
    "process_reward_model": "process-reward-model training pairs its samples",
    "curriculum_sampling": "curriculum sampling keeps the dataset's order; the packer reorders samples into rows",
    "skip_prepare_dataset": "samples are tokenized in the collator, so their lengths are unknown to the packer",
}
# With a processor (`processor_type`), `skip_prepare_dataset` is Axolotl's image+text pipeline: the
# packer processes each sample once for its length and packs image+text rows (packing/multimodal.py).
MULTIMODAL_KEYS = ("processor_type", "skip_prepare_dataset")
# Keys that mean "pack" or "pad less": with the packer on they are turned off, the packer does it.
PACKER_TAKES_OVER = {
    "sample_packing": "Axolotl's multipack",
    "batch_flattening": "HF's flattening collator",
    "group_by_length": "length-grouped sampling (packed rows leave no padding to save)",
}

Rows = Literal["fastqwen", "multipack", "flattening", "padded"]


@dataclass(frozen=True)
class Environment:
    """What the machine the config is loaded on can do (the config alone cannot say)."""

    cuda_devices: int
    processes: int
    flash_attn: bool
    gpu: tuple[str, tuple[int, int]] | None = None  # the first CUDA device's name and compute capability

    @classmethod
    def detect(cls) -> Environment:
        import torch

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(cuda_devices=cuda, processes=int(os.environ.get("WORLD_SIZE") or 1),
                   flash_attn=importlib.util.find_spec("flash_attn") is not None,
                   gpu=(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)) if cuda else None)


@dataclass(frozen=True)
class Decision:
    """One thing the plugin decided for a key: `key: outcome (why)`."""

    key: str
    outcome: str
    why: str

    def __str__(self) -> str:
        return f"{self.key}: {self.outcome} ({self.why})"


@dataclass(frozen=True)
class Settings:
    """Everything below the Axolotl glue reads, decided once at config load."""

    # packing
    rows: Rows  # what makes the training rows
    multimodal: bool  # image+text samples (Axolotl's processor pipeline): packed with their vision inputs
    pack_eval: bool  # the packer makes the evaluation rows too
    token_budget: int  # tokens per packed row (and what `sequence_len x micro_batch_size` gives)
    overlong: str
    sequence_len: int
    micro_batch_size: int
    user_rows: Rows  # what the YAML asked for, for the packing summary's comparison
    step_count_fixed: bool  # `max_steps` set: the packer does not resize the run
    warmup_steps: int | None
    warmup_ratio: float | None
    # kernels and loss
    kernels: str
    kernel_preference: dict[str, str] | None
    fused_ce: bool
    loss_owner: str | None  # the Axolotl loss option that computes the loss (fastqwen_fused_ce: false)
    axolotl_options: tuple[str, ...]  # AXOLOTL_OPTIONS set true
    patch_layers: bool  # False: the model stays stock (context parallelism: its state passing is in stock layers)
    # memory
    checkpointing: Literal["off", "full", "auto"]
    checkpointing_memory: float
    lean_activations: bool
    fp8: bool  # fastqwen_fp8: the frozen projections on FP8 GEMMs
    fp8_input_gradient: str  # fastqwen_fp8_input_gradient: how their input gradients run
    mlp_chunk_tokens: int | None  # fastqwen_mlp_chunk_tokens: dense MLPs over token chunks at long rows
    checkpoint_offload: bool | Literal["auto"]  # fastqwen_checkpoint_offload: recomputed layers' inputs in host memory
    fused_lora: bool  # fastqwen_fused_lora: peft LoRA linears as one function each
    moe_cuda_graphs: bool | Literal["auto"]  # fastqwen_moe_cuda_graphs: kept layers' sparse MoE blocks as CUDA graphs
    # where and how it was decided
    model_source: str | None
    trust_remote_code: bool
    revision: str | None
    output_dir: str | None
    decisions: tuple[Decision, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())  # what a default stepped aside for, for the load report

    @property
    def packer(self) -> bool:
        return self.rows == "fastqwen"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["decisions"] = [str(d) for d in self.decisions]
        return out


class ConfigError(ValueError):
    """A config the plugin refuses: one short paragraph (the key, why, the YAML to paste)."""

    def __init__(self, key: str, why: str, paste: list[str] | None = None, instead: str | None = None):
        self.key, self.why, self.paste, self.instead = key, why, paste or [], instead
        lines = [f"axolotl_fastqwen cannot train this config: {key}", f"  {why}"]
        if instead:
            lines.append(f"  {instead}")
        if self.paste:
            lines.append("  Put this in the YAML:")
            lines += [f"    {line}" for line in self.paste]
        super().__init__("\n".join(lines))


def show_config_errors_without_traceback() -> None:
    """`axolotl train` prints an uncaught error under a long traceback; ours is the whole message."""
    previous = sys.excepthook
    if getattr(previous, "_fastqwen", False):
        return

    def hook(kind, error, tb):
        found = error
        while found is not None and not isinstance(found, ConfigError):
            found = found.__cause__ or found.__context__
        if found is None:
            return previous(kind, error, tb)
        print(f"\n{found}\n", file=sys.stderr)

    hook._fastqwen = True
    sys.excepthook = hook


def _on(value: Any) -> bool:
    return value not in (None, False, "", {}, [], 0, "false", "False")


def _schema_default(key: str, fallback: Any) -> Any:
    """Axolotl's own default for a key the YAML leaves out (one place: its schema)."""
    try:
        from axolotl.utils.schemas.config import AxolotlInputConfig

        default = AxolotlInputConfig.model_fields[key].default
        return fallback if default is None else default
    except (ImportError, KeyError, AttributeError):
        return fallback


def check_plugin_keys(cfg: Mapping) -> FastQwenArgs:
    """The `fastqwen_*` keys, typed; a misspelt or mistyped one is a `ConfigError`."""
    known = set(FastQwenArgs.model_fields)
    ours = {str(k): v for k, v in cfg.items() if str(k).startswith("fastqwen_")}
    unknown = sorted(k for k in ours if k not in known)
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.5) for k in unknown}
        named = ", ".join(f"`{k}`" + (f" (did you mean `{close[k][0]}`?)" if close[k] else "") for k in unknown)
        raise ConfigError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {named}",
            "Axolotl would drop an unknown key and its setting would be silently lost. The options are "
            f"{', '.join(sorted(known))}.",
            paste=[f"{close[k][0]}: {_yaml(ours[k])}" for k in unknown if close[k]])
    try:
        args = FastQwenArgs.model_validate(ours)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "fastqwen_*"
        raise ConfigError(f"`{key}: {_yaml(ours.get(key))}`", f"{first['msg']}.") from None
    if args.fastqwen_token_budget is not None:
        try:
            check_token_budget(args.fastqwen_token_budget)
        except ValueError as err:
            budget = args.fastqwen_token_budget
            up = max(TOKEN_BUDGET_MULTIPLE, -(-budget // TOKEN_BUDGET_MULTIPLE) * TOKEN_BUDGET_MULTIPLE)
            raise ConfigError(f"`fastqwen_token_budget: {budget}`", str(err),
                              paste=[f"fastqwen_token_budget: {up}"]) from None
    try:
        check_op_names(args.fastqwen_kernel_preference or {}, "fastqwen_kernel_preference")
    except ValueError as err:
        raise ConfigError("`fastqwen_kernel_preference`", f"{err}: a preference for no op would be silently "
                          "unused.") from None
    return args


def _yaml(value: Any) -> str:
    return {True: "true", False: "false", None: "null"}.get(value, value) if isinstance(value, (bool, type(None))) \
        else str(value)


def _context_parallel(cfg: Mapping) -> int:
    cp = cfg.get("context_parallel")
    size = cp.get("size") if isinstance(cp, Mapping) else None
    return max(int(cfg.get("context_parallel_size") or 1), int(cfg.get("sequence_parallel_degree") or 1),
               int(size or 1))


def _multimodal(cfg: Mapping) -> bool:
    return all(_on(cfg.get(key)) for key in MULTIMODAL_KEYS)


def _blockers(cfg: Mapping) -> list[tuple[str, str]]:
    found = [(key, why) for key, why in PACKER_BLOCKERS.items() if _on(cfg.get(key))
             and not (key == "skip_prepare_dataset" and _multimodal(cfg))]
    if any(isinstance(d, Mapping) and _on(d.get("streaming")) for d in cfg.get("datasets") or []):
        found.append(("datasets[].streaming", PACKER_BLOCKERS["streaming"]))
    if _context_parallel(cfg) > 1:
        found.append(("context_parallel_size", "context parallelism shards each row across ranks itself"))
    return found


def _user_rows(cfg: Mapping) -> Rows:
    if _multimodal(cfg):  # Axolotl's multipack cannot pack image+text samples: its collator processes no images
        return "padded"
    if _on(cfg.get("sample_packing")):
        return "multipack"
    return "flattening" if _on(cfg.get("batch_flattening")) else "padded"


def resolve(cfg: Mapping, env: Environment) -> tuple[Settings, dict[str, Any]]:
    """The settings of this run, and the edits to make to the config Axolotl goes on to validate.

    Raises `ConfigError` for what contradicts an explicit choice; everything else is decided and
    written down in `Settings.decisions` / `Settings.notes`.
    """
    args = check_plugin_keys(cfg)
    decisions: list[Decision] = []
    notes: list[str] = []
    edits: dict[str, Any] = {}
    sequence_len = int(cfg.get("sequence_len") or _schema_default("sequence_len", 2048))
    micro_batch_size = int(cfg.get("micro_batch_size") or _schema_default("micro_batch_size", 1))
    budget = args.fastqwen_token_budget or -(-sequence_len * micro_batch_size // TOKEN_BUDGET_MULTIPLE) * \
        TOKEN_BUDGET_MULTIPLE
    user_rows = _user_rows(cfg)

    rows, pack_eval = _packing(cfg, user_rows, budget, sequence_len, micro_batch_size, decisions, notes, edits)
    multimodal = rows == "fastqwen" and _multimodal(cfg)
    if multimodal:
        if args.fastqwen_overlong != "error":
            raise ConfigError(
                f"`fastqwen_overlong: {args.fastqwen_overlong}` with image+text data (`processor_type`, "
                "`skip_prepare_dataset`)", "An image is never split, so a sample is packed whole or not at all.",
                instead="Leave fastqwen_overlong unset (a sample longer than the budget is then an error naming it) "
                        "and raise fastqwen_token_budget if needed.", paste=["fastqwen_overlong: error"])
        decisions.append(Decision(
            "processor_type + skip_prepare_dataset", "image+text samples packed by the plugin",
            f"each sample is processed once up front by Axolotl's multimodal collator for its length, then [1, "
            f"{budget}] rows hold several samples with their images, each with its own mRoPE positions"))
    # ---- attention ---------------------------------------------------------------------------
    attn = cfg.get("attn_implementation") or ("flash_attention_2" if _on(cfg.get("flash_attention")) else None)
    if attn in FLASH_ATTENTION and not env.flash_attn:
        edits["attn_implementation"] = "sdpa"
        if "flash_attention" in cfg:
            edits["flash_attention"] = False
        decisions.append(Decision(
            "attn_implementation", f"{attn} -> sdpa outside the decoder's attention",
            "the flash-attn package is not installed; the decoder's full-attention layers run the plugin's varlen "
            "kernel either way, the rest of the model (e.g. a vision tower) runs PyTorch's sdpa"))

    # ---- layers ------------------------------------------------------------------------------
    patch_layers = _context_parallel(cfg) <= 1
    if not patch_layers:
        decisions.append(Decision(
            "context_parallel_size", "the plugin leaves the model's layers stock",
            "Axolotl's context parallelism passes the Gated DeltaNet's recurrent state from rank to rank through "
            "transformers' own layers; the plugin's layers would run each rank's shard of a row alone"))

    # ---- memory ------------------------------------------------------------------------------
    checkpointing, why_not_auto = _checkpointing(cfg, args.fastqwen_checkpointing, rows == "fastqwen", env)
    if why_not_auto and args.fastqwen_checkpointing == "auto":
        decisions.append(Decision("fastqwen_checkpointing", f"auto steps aside: {checkpointing}", why_not_auto))
    elif why_not_auto and checkpointing == "full":
        notes.append(f"fastqwen_checkpointing: full (default; auto would keep the activations of the layers that fit, "
                     f"but {why_not_auto})")
    elif checkpointing == "auto" and args.fastqwen_checkpointing is None:
        decisions.append(Decision("fastqwen_checkpointing", "auto (default)", "gradient_checkpointing is on: the "
                                  "layers whose activations fit in memory are kept, the rest recomputed"))
    if checkpointing == "auto" and cfg.get("activation_offloading") == "hidden_states":
        notes.append("activation_offloading: hidden_states with fastqwen_checkpointing: auto: Axolotl's offloader "
                     "moves the inputs of the layers auto recomputes; the layers it keeps are not offloaded, and auto "
                     "sizes itself with the offload on")
    lean, lean_note = _lean_activations(cfg, args.fastqwen_lean_activations, checkpointing)
    lean = lean and patch_layers
    if lean_note:
        notes.append(lean_note)

    fp8 = _fp8(cfg, args.fastqwen_fp8, env, patch_layers, decisions, edits)
    fused_lora = args.fastqwen_fused_lora
    sharded = [k for k in ("fsdp", "fsdp_config", "deepspeed") if _on(cfg.get(k))]
    if fused_lora and sharded:
        fused_lora = False
        notes.append(f"fused LoRA off: {', '.join(sharded)} set (their hooks gather each weight when its own module "
                     "runs, and the fused layer reads lora_B's weight without calling lora_B): peft's forward runs")
    moe_cuda_graphs = _moe_cuda_graphs(cfg, args.fastqwen_moe_cuda_graphs, rows, sharded, notes, env)
    chunk, most = args.fastqwen_mlp_chunk_tokens, max(budget, sequence_len * micro_batch_size)
    if chunk is not None and chunk >= most:
        notes.append(f"fastqwen_mlp_chunk_tokens: {chunk} is at least the {most} tokens a micro-batch holds, so no "
                     f"MLP runs in chunks (set it below that, e.g. {max(64, most // 4)}, to use it)")
    offload = _checkpoint_offload(cfg, args.fastqwen_checkpoint_offload, checkpointing, patch_layers, notes, env)
    if args.fastqwen_fp8_input_gradient != "fp8" and not fp8:
        raise ConfigError(f"`fastqwen_fp8_input_gradient: {args.fastqwen_fp8_input_gradient}`",
                          "it says how the FP8 projections' input gradients run, and fastqwen_fp8 is off.",
                          instead="Set fastqwen_fp8: true, or remove fastqwen_fp8_input_gradient.",
                          paste=["fastqwen_fp8: true"])
    fused_ce = args.fastqwen_fused_ce
    options = tuple(key for key in AXOLOTL_OPTIONS if _on(cfg.get(key)) and edits.get(key) is not False)
    loss_owner = None if fused_ce else next((k for k in ("liger_fused_linear_cross_entropy", "cut_cross_entropy")
                                             if k in options), None)
    settings = Settings(
        rows=rows, multimodal=multimodal, pack_eval=pack_eval, token_budget=budget, overlong=args.fastqwen_overlong,
        sequence_len=sequence_len, micro_batch_size=micro_batch_size, user_rows=user_rows,
        step_count_fixed=_on(cfg.get("max_steps")), warmup_steps=cfg.get("warmup_steps"),
        warmup_ratio=cfg.get("warmup_ratio"), kernels=args.fastqwen_kernels,
        kernel_preference=args.fastqwen_kernel_preference or None, fused_ce=fused_ce, loss_owner=loss_owner,
        axolotl_options=options, patch_layers=patch_layers, checkpointing=checkpointing,
        checkpointing_memory=args.fastqwen_checkpointing_memory, lean_activations=lean, fp8=fp8,
        fp8_input_gradient=args.fastqwen_fp8_input_gradient, mlp_chunk_tokens=args.fastqwen_mlp_chunk_tokens,
        checkpoint_offload=offload, fused_lora=fused_lora, moe_cuda_graphs=moe_cuda_graphs, model_source=cfg.get("base_model_config") or cfg.get("base_model"),
        trust_remote_code=bool(cfg.get("trust_remote_code")), revision=cfg.get("revision_of_model"),
        output_dir=cfg.get("output_dir"), decisions=tuple(decisions), notes=tuple(notes))
    return settings, edits


def _packing(cfg: Mapping, user_rows: Rows, budget: int, sequence_len: int, micro_batch_size: int,
             decisions: list, notes: list, edits: dict) -> tuple[Rows, bool]:
    """What makes the training rows and whether the packer packs evaluation too; the keys it takes
    over are turned off (`edits`), and every decision is written down."""
    explicit = cfg.get("fastqwen_packing")
    blockers = _blockers(cfg)
    if explicit is False:
        if user_rows == "multipack":
            notes.append("fastqwen_packing: false: Axolotl's multipack rows, their boundaries read exactly from its "
                         "attention_mask ids")
        return user_rows, False
    if blockers:
        key, why = blockers[0]
        if explicit is True:
            raise ConfigError(
                f"`fastqwen_packing: true` with `{key}`", f"The plugin's packer cannot run here: {why}.",
                instead="Either drop `fastqwen_packing: true` (the plugin then leaves the rows to Axolotl, with its "
                        f"fused kernels still on), or remove `{key}`.",
                paste=["fastqwen_packing: false"])
        decisions.append(Decision("fastqwen_packing", f"off, the rows are {_describe_rows(user_rows)}",
                                  f"`{key}` is set: {why}; the fused kernels still run"))
        return user_rows, False
    eval_wanted = cfg.get("eval_sample_packing")
    for key, what in PACKER_TAKES_OVER.items():
        if _on(cfg.get(key)):
            edits[key] = False
            done = f"{what} replaced by the plugin's packer"
            if key == "sample_packing" and _multimodal(cfg):
                done = ("the plugin's packer packs the image+text samples (Axolotl's multipack cannot: its collator "
                        "processes no images; without the plugin they run one sample per micro-batch)")
            decisions.append(Decision(f"{key}: true", done, _takeover_why(budget, sequence_len, micro_batch_size)))
    if eval_wanted is not None or _on(cfg.get("sample_packing")):
        edits["eval_sample_packing"] = False  # Axolotl must not build multipack eval rows: the packer's run
    if eval_wanted is False:
        decisions.append(Decision("eval_sample_packing: false", "kept: evaluation runs on Axolotl's padded "
                                  "batches", "the packer packs the training rows only"))
    elif _on(eval_wanted):
        decisions.append(Decision("eval_sample_packing: true", "Axolotl's multipack replaced by the plugin's "
                                  "packer", "evaluation rows are packed like the training rows"))
    return "fastqwen", eval_wanted is not False


def _describe_rows(rows: Rows) -> str:
    return {"multipack": "Axolotl's multipack rows (boundaries read exactly from its attention_mask ids)",
            "flattening": "HF's flattened rows (boundaries read from their position_ids)",
            "padded": "padded batches", "fastqwen": "the plugin's packed rows"}[rows]


def _takeover_why(budget: int, sequence_len: int, micro_batch_size: int) -> str:
    default = budget == -(-sequence_len * micro_batch_size // TOKEN_BUDGET_MULTIPLE) * TOKEN_BUDGET_MULTIPLE
    size = (f"sequence_len x micro_batch_size = {sequence_len} x {micro_batch_size}: the same tokens per step"
            if default else "fastqwen_token_budget")
    return (f"one static [1, {budget}] row per micro-batch ({size}); exact sequence boundaries, no label trained "
            "across one; the step composition changes: steps per epoch, warm-up and eval/save cadence in steps")


def _moe_cuda_graphs(cfg: Mapping, wanted: bool | str, rows: str, sharded: list[str], notes: list[str],
                     env: Environment) -> bool | str:
    """`fastqwen_moe_cuda_graphs`: off where weights are sharded (whatever was asked); `auto` (the default)
    also steps aside, with a note, where it was not validated: no CUDA device, several processes,
    torch_compile, or rows the plugin does not pack (another shape each batch: nothing would replay)."""
    if not wanted:
        return False
    if sharded:
        notes.append(f"moe cuda graphs off: {', '.join(sharded)} set (a graph replays the addresses its weights had at "
                     "capture; sharded weights are gathered anew for each call)")
        return False
    if wanted is True:
        return True
    if env.cuda_devices == 0:
        return False  # nothing to capture on: quietly off, as the graphs' own check would leave every call eager
    why = []
    if env.processes > 1:
        why.append(f"{env.processes} processes (validated on one GPU; set fastqwen_moe_cuda_graphs: true to capture "
                   "in each)")
    if _on(cfg.get("torch_compile")):
        why.append("torch_compile set (a compiled block runs as compiled)")
    if rows != "fastqwen":
        why.append(f"the rows are {_describe_rows(rows)}, whose shape may change from batch to batch, and a graph "
                   "replays only the shape it captured (the plugin's packed rows have one)")
    if why:
        notes.append(f"fastqwen_moe_cuda_graphs: auto is off: {'; '.join(why)}")
        return False
    return "auto"


def _checkpoint_offload(cfg: Mapping, wanted: bool | str, checkpointing: str, patch_layers: bool,
                        notes: list[str], env: Environment) -> bool | str:
    """`fastqwen_checkpoint_offload`: `true` is refused where there is nothing of its own to move;
    `auto` (the default) steps aside there, and where it was not validated, with a note saying why."""
    if not wanted:
        return False
    offloading = cfg.get("activation_offloading")
    axolotls = _on(offloading) or cfg.get("gradient_checkpointing") in ("offload", "offload_disk")
    if wanted == "auto":
        if not patch_layers or checkpointing == "off":
            return False  # nothing is recomputed by the plugin's layers: nothing to move
        why = []
        if axolotls:
            why.append("Axolotl's activation offloading moves the recomputed layers' inputs itself")
        if env.processes > 1:
            why.append(f"{env.processes} processes would each pin up to half the host's memory (set "
                       "fastqwen_checkpoint_offload: true to offload in each)")
        unvalidated = [k for k in (*SHARDING_KEYS, "torch_compile") if _on(cfg.get(k))]
        if unvalidated:
            why.append(f"{', '.join(unvalidated)} set: the offload is validated on one unsharded, uncompiled model")
        if why:
            notes.append(f"fastqwen_checkpoint_offload: auto is off: {'; '.join(why)}")
            return False
        return "auto"
    if axolotls:
        key = (f"activation_offloading: {offloading}" if _on(offloading)
               else f"gradient_checkpointing: {cfg.get('gradient_checkpointing')}")
        raise ConfigError(f"`fastqwen_checkpoint_offload: true` with `{key}`",
                          "Axolotl's offloader moves the same activations to host memory; two offloaders would each "
                          "copy them.",
                          instead="Keep one: remove fastqwen_checkpoint_offload (Axolotl's offloader), or set the "
                                  "lines below (the plugin's: it prefetches each layer's input one layer ahead and "
                                  "composes with fastqwen_checkpointing: auto).",
                          paste=["activation_offloading: false", "gradient_checkpointing: true"])
    if checkpointing == "off":
        raise ConfigError("`fastqwen_checkpoint_offload: true` without gradient checkpointing",
                          "it moves the inputs that recomputed layers keep, and with gradient_checkpointing off no "
                          "layer is recomputed.",
                          instead="Turn gradient checkpointing on, or remove fastqwen_checkpoint_offload.",
                          paste=["gradient_checkpointing: true"])
    return patch_layers


def _checkpointing(cfg: Mapping, explicit: str | None, packer: bool, env: Environment) -> tuple[str, str | None]:
    """The checkpointing mode, and why `auto` does not run (None when it does, or is not wanted)."""
    gc = cfg.get("gradient_checkpointing")
    if not _on(gc):
        if explicit == "auto":
            return "off", ("gradient_checkpointing is off: every layer keeps its activations already, nothing is "
                           "recomputed for auto to save")
        return "off", None
    if explicit == "full":
        return "full", None
    why = []
    offloading = cfg.get("activation_offloading")
    if gc in ("offload", "offload_disk") or (_on(offloading) and offloading != "hidden_states"):
        why.append("activation_offloading is on: Axolotl's offloader replaces recompute and moves activations off "
                   "the GPU, where auto cannot measure them (set activation_offloading: false to let auto keep what "
                   "fits)")
    if not packer:
        why.append("the plugin's packer is off: auto sizes itself on one static row shape")
    if _on(cfg.get("torch_compile")):
        why.append("torch_compile is on: each change of the recomputed layers would recompile")
    sharded = [k for k in SHARDING_KEYS if _on(cfg.get(k))]
    if sharded:
        why.append(f"{', '.join(sharded)} set: auto measures one unsharded device")
    if explicit is None and env.processes > 1:
        why.append(f"{env.processes} processes: auto fits one device (set fastqwen_checkpointing: auto to fit each)")
    if explicit is None and not env.cuda_devices:
        why.append("no CUDA device: peak memory cannot be measured")
    if why:
        return "full", "; ".join(why)
    return "auto", None


# What `fastqwen_fp8: true` cannot run with, and why (refused at config load).
FP8_CLASHES = {
    "load_in_4bit": "the base is already quantized to 4 bits (QLoRA); FP8 would re-quantize 4-bit values, and QLoRA "
                    "bases are out of its scope",
    "load_in_8bit": "the base is already quantized to 8 bits (bitsandbytes int8)",
    "fsdp": "FSDP shards and gathers the weights that FP8 replaces",
    "fsdp_config": "FSDP shards and gathers the weights that FP8 replaces",
    "deepspeed": "DeepSpeed partitions and casts the weights that FP8 replaces",
    "torch_compile": "the FP8 projections (a Triton quantization kernel and cuBLAS FP8 GEMMs in a custom autograd "
                     "function) are not validated under torch.compile",
}
LORA_KERNELS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel")


def _fp8(cfg: Mapping, wanted: bool, env: Environment, patch_layers: bool, decisions: list, edits: dict) -> bool:
    """`fastqwen_fp8: true` where it can run; a `ConfigError` naming what to change where it cannot."""
    if not wanted:
        return False
    paste = ["fastqwen_fp8: false"]
    why = [f"`{key}` is set: {reason}" for key, reason in FP8_CLASHES.items() if _on(cfg.get(key))]
    adapter = cfg.get("adapter")
    if adapter not in ("lora", "qlora"):
        why.append("there is no adapter (full fine-tuning): FP8 is for a frozen base under LoRA (`adapter: lora`), "
                   "whose weights never change and never need a gradient")
    if not patch_layers:
        why.append("context parallelism leaves the model's layers stock")
    if env.processes > 1:
        why.append(f"{env.processes} processes: FP8 is measured and validated on one GPU")
    if not env.cuda_devices:
        why.append("no CUDA GPU here: FP8 tensor cores with row-wise scaling exist on Hopper (sm_90) and newer")
    elif env.gpu is not None and tuple(env.gpu[1]) < MIN_CAPABILITY:
        name, capability = env.gpu
        why.append(f"{name} (sm_{capability[0]}{capability[1]}) has no FP8 tensor cores with row-wise scaling "
                   "(Hopper, sm_90, or newer)")
    if why:
        raise ConfigError("`fastqwen_fp8: true`", "; ".join(why) + ".",
                          instead="Remove fastqwen_fp8 (the run then trains in bf16 exactly as without it), or "
                                  "change what is named above.", paste=paste)
    kernels = [key for key in LORA_KERNELS if _on(cfg.get(key))]
    for key in kernels:
        edits[key] = False
    if kernels:
        decisions.append(Decision(", ".join(kernels), "off", "fastqwen_fp8 runs the frozen projections' GEMMs in FP8; "
                                  "Axolotl's LoRA kernels would run them from the bf16 weight, which FP8 frees"))
    decisions.append(Decision("fastqwen_fp8: true", "the decoder's large frozen projections on FP8 GEMMs",
                              "each weight shape is self-checked and timed on this GPU at load; the load report "
                              "lists which run FP8"))
    return True


def _lean_activations(cfg: Mapping, explicit: bool | None, checkpointing: str) -> tuple[bool, str | None]:
    """Whether lean activations run, and the report note that says why they do nothing, if so."""
    clashes = [k for k in ("fsdp", "fsdp_config", "deepspeed", "torch_compile") if _on(cfg.get(k))]
    why_clash = ("sharded weights are freed after the forward, before its recompute reads them, and a compiled "
                 "forward does not run its hooks")
    if explicit is True and clashes:
        raise ConfigError(
            f"`fastqwen_lean_activations: true` with {', '.join(f'`{k}`' for k in clashes)}", f"{why_clash}.",
            instead="Leave fastqwen_lean_activations unset (it steps aside by itself here), or remove those keys.",
            paste=["fastqwen_lean_activations: false"])
    if explicit is False:
        return False, None
    every_layer_recomputed = checkpointing == "full"
    if explicit is None and clashes:
        return False, f"lean activations off (default): {', '.join(clashes)} set, and {why_clash}"
    if explicit is None and every_layer_recomputed:
        return False, ("lean activations off (default): gradient_checkpointing recomputes every layer, so none keeps "
                       "activations to drop; fastqwen_checkpointing: auto keeps some and turns them on")
    if explicit and every_layer_recomputed:
        return True, ("fastqwen_lean_activations drops nothing here: gradient_checkpointing recomputes every layer "
                      "(fastqwen_checkpointing: full); it pays with fastqwen_checkpointing: auto")
    return True, None

