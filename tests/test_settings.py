"""The YAML read once (`integration/settings.py`): what the plugin takes over, where it steps aside,
and the few contradictions it refuses, each in one short paragraph with the key, why and the fix.

Each case is checked against the config Axolotl goes on to validate (the edits) and the decisions
the log and the report show; `tests/test_axolotl_examples.py` runs the same rules through real
`axolotl train` runs.
"""

from __future__ import annotations

import pytest

from axolotl_fastqwen.integration.keys import FastQwenArgs
from axolotl_fastqwen.integration.settings import ConfigError, Environment, resolve

GPU = Environment(cuda_devices=1, processes=1, flash_attn=True)
CPU = Environment(cuda_devices=0, processes=1, flash_attn=False)
BASE = {"sequence_len": 2048, "micro_batch_size": 2}


def settle(env=GPU, **cfg):
    return resolve({**BASE, **cfg}, env)


def decided(settings) -> str:
    return "\n".join(str(d) for d in settings.decisions)


# ---- packing ---------------------------------------------------------------------------------
def test_sample_packing_means_pack_my_data_the_packer_takes_over_at_the_same_tokens_per_step():
    settings, edits = settle(sample_packing=True, eval_sample_packing=True)
    assert settings.rows == "fastqwen" and settings.pack_eval and settings.user_rows == "multipack"
    assert settings.token_budget == 2048 * 2  # multipack's micro-batch: 2 rows of sequence_len
    assert edits == {"sample_packing": False, "eval_sample_packing": False}
    text = decided(settings)
    assert "sample_packing: true: Axolotl's multipack replaced by the plugin's packer" in text
    assert "sequence_len x micro_batch_size = 2048 x 2: the same tokens per step" in text
    assert "steps per epoch, warm-up and eval/save cadence in steps" in text
    assert "eval_sample_packing: true: Axolotl's multipack replaced" in text


def test_the_budget_rounds_up_to_the_grid_and_an_explicit_budget_wins():
    assert resolve({"sequence_len": 500, "micro_batch_size": 3}, GPU)[0].token_budget == 1536
    settings, _ = settle(sample_packing=True, fastqwen_token_budget=16384)
    assert settings.token_budget == 16384 and "fastqwen_token_budget" in decided(settings)


def test_axolotls_default_sequence_len_is_its_schemas():
    pytest.importorskip("axolotl")
    from axolotl.utils.schemas.config import AxolotlInputConfig

    settings, _ = resolve({}, CPU)
    assert settings.sequence_len == AxolotlInputConfig.model_fields["sequence_len"].default
    assert settings.micro_batch_size == 1


def test_eval_sample_packing_false_keeps_evaluation_on_padded_batches():
    settings, edits = settle(sample_packing=True, eval_sample_packing=False)
    assert settings.packer and not settings.pack_eval
    assert edits == {"sample_packing": False, "eval_sample_packing": False}
    assert "eval_sample_packing: false: kept: evaluation runs on Axolotl's padded batches" in decided(settings)


@pytest.mark.parametrize("key", ["batch_flattening", "group_by_length"])
def test_other_pad_less_keys_are_taken_over_too(key):
    settings, edits = settle(**{key: True})
    assert settings.packer and edits == {key: False}
    assert f"{key}: true:" in decided(settings)


@pytest.mark.parametrize(("key", "value", "why"), [
    ("streaming", True, "streaming datasets"),
    ("pretraining_dataset", [{"path": "x"}], "streaming pretraining data"),
    ("rl", "dpo", "preference / RL trainers"),
    ("reward_model", True, "reward-model"),
    ("curriculum_sampling", True, "curriculum sampling keeps the dataset's order"),
    ("skip_prepare_dataset", True, "tokenized in the collator"),
    ("context_parallel_size", 2, "context parallelism"),
    ("context_parallel", {"size": 4}, "context parallelism"),
    ("datasets", [{"path": "x", "streaming": True}], "streaming datasets"),
])
def test_where_the_packer_cannot_run_it_steps_aside_to_axolotls_rows_with_the_kernels_on(key, value, why):
    settings, edits = settle(sample_packing=True, **{key: value})
    assert settings.rows == "multipack" and not settings.packer  # what the YAML asked for
    assert edits == {}  # sample_packing stays: Axolotl's rows, read exactly by the patched model
    text = decided(settings)
    assert "fastqwen_packing: off, the rows are Axolotl's multipack rows" in text and why in text
    assert "the fused kernels still run" in text
    settings, _ = settle(**{key: value})
    assert settings.rows == "padded"


def test_an_explicit_packer_that_cannot_run_is_refused_in_one_short_paragraph():
    with pytest.raises(ConfigError) as err:
        settle(fastqwen_packing=True, streaming=True)
    text = str(err.value)
    lines = text.splitlines()
    assert lines[0] == "axolotl_fastqwen cannot train this config: `fastqwen_packing: true` with `streaming`"
    assert "needs every sample's length" in text and "fastqwen_packing: false" in lines[-1]
    assert len(lines) <= 6 and "input_value" not in text and "Traceback" not in text


def test_packing_off_leaves_axolotls_multipack_rows():
    settings, edits = settle(fastqwen_packing=False, sample_packing=True)
    assert settings.rows == "multipack" and edits == {} and not settings.decisions
    assert any("boundaries read exactly" in note for note in settings.notes)


# ---- attention -------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [{"attn_implementation": "flash_attention_2"}, {"flash_attention": True}])
def test_flash_attention_without_flash_attn_runs_sdpa_outside_the_decoders_attention(cfg):
    settings, edits = settle(CPU, **cfg)
    assert edits["attn_implementation"] == "sdpa"
    assert edits.get("flash_attention", False) is False
    assert "the flash-attn package is not installed" in decided(settings)
    assert settle(GPU, **cfg)[1] == {}  # installed: left as asked


# ---- checkpointing ---------------------------------------------------------------------------
def test_auto_is_the_default_wherever_checkpointing_is_on_and_auto_can_run():
    settings, _ = settle(gradient_checkpointing=True)
    assert settings.checkpointing == "auto" and settings.lean_activations
    assert "fastqwen_checkpointing: auto (default)" in decided(settings)
    assert settle(gradient_checkpointing=False)[0].checkpointing == "off"


@pytest.mark.parametrize(("env", "cfg", "why"), [
    (CPU, {}, "no CUDA device"),
    (Environment(2, 2, True), {}, "2 processes"),
    (GPU, {"activation_offloading": True}, "activation_offloading is on"),
    (GPU, {"gradient_checkpointing": "offload"}, "activation_offloading is on"),
    (GPU, {"torch_compile": True}, "torch_compile"),
    (GPU, {"fsdp_config": {"fsdp_version": 2}}, "fsdp_config set"),
    (GPU, {"deepspeed": "zero3.json"}, "deepspeed set"),
    (GPU, {"fastqwen_packing": False}, "packer is off"),
])
def test_elsewhere_the_default_is_full_with_the_reason_in_the_report(env, cfg, why):
    settings, _ = settle(env, **{"gradient_checkpointing": True, **cfg})
    assert settings.checkpointing == "full"
    assert any(n.startswith("fastqwen_checkpointing: full (default;") and why in n for n in settings.notes), settings.notes


def test_an_explicit_auto_that_cannot_run_steps_aside_with_a_note_never_an_error():
    settings, _ = settle(gradient_checkpointing=True, activation_offloading=True, fastqwen_checkpointing="auto")
    assert settings.checkpointing == "full"
    assert "fastqwen_checkpointing: auto steps aside: full (activation_offloading is on" in decided(settings)
    settings, _ = settle(gradient_checkpointing=False, fastqwen_checkpointing="auto")
    assert settings.checkpointing == "off" and "nothing is recomputed" in decided(settings)


def test_an_explicit_auto_runs_where_the_default_would_not_and_its_fitter_decides():
    """No CUDA device, or several processes: `auto` asked for runs, and the fitter says what it did
    (on a CPU: every layer recomputed, no peak-memory counters)."""
    assert settle(CPU, gradient_checkpointing=True, fastqwen_checkpointing="auto")[0].checkpointing == "auto"
    assert settle(Environment(2, 2, True), gradient_checkpointing=True,
                  fastqwen_checkpointing="auto")[0].checkpointing == "auto"
    assert settle(gradient_checkpointing=True, fastqwen_checkpointing="full")[0].checkpointing == "full"


def test_the_memory_fraction_is_bounded():
    assert settle(fastqwen_checkpointing_memory=0.7)[0].checkpointing_memory == 0.7
    with pytest.raises(ConfigError, match="fastqwen_checkpointing_memory"):
        settle(fastqwen_checkpointing_memory=1.2)


# ---- lean activations ------------------------------------------------------------------------
def test_lean_activations_default_on_and_steps_aside_for_sharding_compile_and_full_checkpointing():
    assert settle()[0].lean_activations
    assert settle(torch_compile=False, fsdp_config={})[0].lean_activations
    assert settle(gradient_checkpointing=True)[0].lean_activations  # auto keeps layers
    assert not settle(fastqwen_lean_activations=False)[0].lean_activations
    settings, _ = settle(fastqwen_lean_activations=True, gradient_checkpointing=True, fastqwen_checkpointing="full")
    assert settings.lean_activations
    assert any(n.startswith("fastqwen_lean_activations drops nothing here") for n in settings.notes)
    settings, _ = settle(fsdp_config={"fsdp_version": 2}, torch_compile=True)
    assert not settings.lean_activations
    assert any(n.startswith("lean activations off (default): fsdp_config, torch_compile set") for n in settings.notes)
    settings, _ = settle(CPU, gradient_checkpointing=True)
    assert not settings.lean_activations
    assert any("gradient_checkpointing recomputes every layer" in n for n in settings.notes)


@pytest.mark.parametrize(("cfg", "named"), [
    ({"fsdp_config": {"fsdp_version": 2}}, "`fsdp_config`"),
    ({"torch_compile": True, "deepspeed": "zero3.json"}, "`deepspeed`, `torch_compile`"),
])
def test_lean_activations_true_with_sharding_or_compile_is_refused(cfg, named):
    with pytest.raises(ConfigError) as err:
        settle(fastqwen_lean_activations=True, **cfg)
    assert f"`fastqwen_lean_activations: true` with {named}" in str(err.value)
    assert "fastqwen_lean_activations: false" in str(err.value)


def test_fused_lora_default_on_off_by_key_and_aside_for_sharded_weights():
    assert settle()[0].fused_lora and settle(torch_compile=True)[0].fused_lora
    assert not settle(fastqwen_fused_lora=False)[0].fused_lora
    for cfg in ({"fsdp_config": {"fsdp_version": 2}}, {"deepspeed": "zero3.json"}):
        settings, _ = settle(**cfg)
        assert not settings.fused_lora
        assert any(n.startswith("fused LoRA off:") and "peft's forward runs" in n for n in settings.notes)


def test_moe_cuda_graphs_auto_where_the_packer_gives_one_row_shape_on_one_gpu_and_never_on_sharded_weights():
    """`fastqwen_moe_cuda_graphs: auto` (the default) is on where it was validated: the plugin's packed rows
    (one shape, so the captured graphs replay) on one CUDA device without torch_compile; elsewhere it steps
    aside with a note naming the reason (quietly on a CPU, where nothing is captured). `true` insists, except
    on sharded weights (a graph replays the addresses its weights had at capture)."""
    packed = {"sample_packing": True}
    assert settle(**packed)[0].moe_cuda_graphs == "auto"
    settings, _ = settle(CPU, **packed)
    assert settings.moe_cuda_graphs is False and not any("moe_cuda_graphs" in n for n in settings.notes)
    assert settle(fastqwen_moe_cuda_graphs=False, **packed)[0].moe_cuda_graphs is False
    for env, cfg, why in (
            (GPU, {"fastqwen_packing": False}, "the rows are padded batches"),
            (Environment(cuda_devices=2, processes=2, flash_attn=True), packed, "2 processes"),
            (GPU, {**packed, "torch_compile": True}, "torch_compile set")):
        settings, _ = settle(env, **cfg)
        assert settings.moe_cuda_graphs is False
        assert any(n.startswith("fastqwen_moe_cuda_graphs: auto is off:") and why in n for n in settings.notes), \
            settings.notes
        assert settle(env, fastqwen_moe_cuda_graphs=True, **cfg)[0].moe_cuda_graphs is True
    for cfg in ({"fsdp_config": {"fsdp_version": 2}}, {"deepspeed": "zero3.json"}):
        for wanted in (True, "auto"):
            settings, _ = settle(fastqwen_moe_cuda_graphs=wanted, **packed, **cfg)
            assert not settings.moe_cuda_graphs
            assert any(n.startswith("moe cuda graphs off:") for n in settings.notes)


# ---- the keys themselves ---------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "message", "paste"), [
    ({"fastqwen_token_budget": 1000}, "got 1000", "fastqwen_token_budget: 1024"),
    ({"fastqwen_token_budget": 0}, "got 0", "fastqwen_token_budget: 64"),
    ({"fastqwen_kernels": "fast"}, "`fastqwen_kernels: fast`", None),
    ({"fastqwen_overlong": "drop"}, "`fastqwen_overlong: drop`", None),
    ({"fastqwen_kernel_preference": {"gdn": "flash-qla"}}, "unknown op(s) ['gdn']; the ops are gated_delta_rule", None),
    ({"fastqwen_pakcing": False, "fastqwen_token_budgett": 1024},
     "`fastqwen_pakcing` (did you mean `fastqwen_packing`?), `fastqwen_token_budgett` (did you mean "
     "`fastqwen_token_budget`?)", "fastqwen_token_budget: 1024"),
])
def test_bad_keys_name_the_key_and_the_fix(cfg, message, paste):
    with pytest.raises(ConfigError) as err:
        resolve(cfg, CPU)
    assert message in str(err.value)
    if paste:
        assert paste in str(err.value).splitlines()[-1]


def test_unrelated_keys_are_axolotls_business_and_defaults_decide_nothing_unasked():
    settings, edits = resolve({"unrelated_key": 1}, CPU)
    assert edits == {} and settings.decisions == ()
    args = FastQwenArgs.model_validate({})
    assert (args.fastqwen_packing, args.fastqwen_checkpointing, args.fastqwen_lean_activations) == (None, None, None)
    assert (args.fastqwen_kernels, args.fastqwen_overlong, args.fastqwen_fused_ce) == ("auto", "error", True)
    settings, _ = resolve({"fastqwen_kernel_preference": {"gated_delta_rule": "flash-qla"}}, CPU)
    assert settings.kernel_preference == {"gated_delta_rule": "flash-qla"}


@pytest.mark.parametrize("cfg", [{"context_parallel_size": 2}, {"context_parallel": {"size": 4}},
                                 {"sequence_parallel_degree": 2}])
def test_under_context_parallelism_the_model_stays_stock(cfg):
    """Axolotl's context parallelism passes the GDN state between ranks inside transformers' own
    layers: the plugin's layers would compute each rank's shard alone, so it leaves them stock (and
    its packer, which cannot shard a row, steps aside too)."""
    settings, edits = settle(sample_packing=True, gradient_checkpointing=True, **cfg)
    assert not settings.patch_layers and settings.rows == "multipack" and edits == {}
    assert not settings.lean_activations and settings.checkpointing == "full"
    assert "the plugin leaves the model's layers stock" in decided(settings)
    assert settle()[0].patch_layers


def test_image_text_data_through_axolotls_processor_is_packed():
    """`processor_type` + `skip_prepare_dataset` (Axolotl's vision pipeline): the packer processes
    each sample once for its length and packs image+text rows; `skip_prepare_dataset` alone (no
    processor) still leaves the rows to Axolotl."""
    settings, edits = settle(processor_type="AutoProcessor", skip_prepare_dataset=True, sample_packing=False)
    assert settings.multimodal and settings.packer and edits == {}
    assert "image+text samples packed by the plugin" in decided(settings)
    settings, _ = settle(skip_prepare_dataset=True)
    assert not settings.multimodal and not settings.packer
    assert not settle(processor_type="AutoProcessor", skip_prepare_dataset=True,
                      fastqwen_packing=False)[0].multimodal
    with pytest.raises(ConfigError, match="An image is never split"):
        settle(processor_type="AutoProcessor", skip_prepare_dataset=True, fastqwen_overlong="truncate")
    # `sample_packing: true` there: what the user had is one-sample batches, not multipack rows
    settings, edits = settle(processor_type="AutoProcessor", skip_prepare_dataset=True, sample_packing=True)
    assert settings.user_rows == "padded" and edits == {"sample_packing": False, "eval_sample_packing": False}
    assert "Axolotl's multipack cannot" in decided(settings) and "multipack replaced" not in decided(settings)


# ---- fastqwen_fp8 ----------------------------------------------------------------------------
HOPPER = Environment(cuda_devices=1, processes=1, flash_attn=False, gpu=("NVIDIA H100 80GB HBM3", (9, 0)))
LORA = {"adapter": "lora", "sample_packing": True}


def test_fp8_is_off_unless_asked_and_a_yaml_without_it_is_unchanged():
    assert not settle(HOPPER, **LORA)[0].fp8
    settings, edits = settle(HOPPER, **LORA, lora_mlp_kernel=True)
    assert "lora_mlp_kernel" not in edits and "lora_mlp_kernel" in settings.axolotl_options


def test_fp8_on_hopper_with_lora_runs_and_turns_axolotls_lora_kernels_off():
    settings, edits = settle(HOPPER, **LORA, fastqwen_fp8=True, lora_qkv_kernel=True, lora_o_kernel=True,
                             lora_mlp_kernel=False)
    assert settings.fp8
    assert edits["lora_qkv_kernel"] is False and edits["lora_o_kernel"] is False and "lora_mlp_kernel" not in edits
    assert not {"lora_qkv_kernel", "lora_o_kernel"} & set(settings.axolotl_options)
    text = decided(settings)
    assert "lora_qkv_kernel, lora_o_kernel: off (fastqwen_fp8 runs the frozen projections' GEMMs in FP8" in text
    assert "fastqwen_fp8: true: the decoder's large frozen projections on FP8 GEMMs" in text


@pytest.mark.parametrize("env, cfg, named", [
    (HOPPER, {"load_in_4bit": True, "adapter": "qlora"}, "`load_in_4bit` is set: the base is already quantized to 4"),
    (HOPPER, {"load_in_8bit": True}, "`load_in_8bit` is set"),
    (HOPPER, {"adapter": None}, "there is no adapter (full fine-tuning)"),
    (HOPPER, {"fsdp_config": {"fsdp_version": 2}}, "`fsdp_config` is set: FSDP shards"),
    (HOPPER, {"deepspeed": "zero3.json"}, "`deepspeed` is set"),
    (HOPPER, {"torch_compile": True}, "`torch_compile` is set"),
    (HOPPER, {"context_parallel_size": 2}, "context parallelism leaves the model's layers stock"),
    (Environment(2, 2, False, ("NVIDIA H100", (9, 0))), {}, "2 processes: FP8 is measured and validated on one GPU"),
    (CPU, {}, "no CUDA GPU here: FP8 tensor cores with row-wise scaling exist on Hopper (sm_90) and newer"),
    (Environment(1, 1, False, ("NVIDIA A100-SXM4-80GB", (8, 0))), {}, "NVIDIA A100-SXM4-80GB (sm_80) has no FP8"),
])
def test_fp8_where_it_cannot_run_is_refused_at_config_load_with_the_reason(env, cfg, named):
    with pytest.raises(ConfigError) as err:
        settle(env, **{**LORA, **cfg, "fastqwen_fp8": True})
    text = str(err.value)
    assert text.startswith("axolotl_fastqwen cannot train this config: `fastqwen_fp8: true`")
    assert named in text and "fastqwen_fp8: false" in text and "trains in bf16 exactly as without it" in text


def test_fp8_input_gradient_reaches_the_settings_and_is_refused_without_fp8():
    assert settle(HOPPER, **LORA, fastqwen_fp8=True)[0].fp8_input_gradient == "fp8"
    settings, _ = settle(HOPPER, **LORA, fastqwen_fp8=True, fastqwen_fp8_input_gradient="bf16")
    assert settings.fp8 and settings.fp8_input_gradient == "bf16"
    with pytest.raises(ConfigError) as err:
        settle(HOPPER, **LORA, fastqwen_fp8_input_gradient="fp8-1x128")
    text = str(err.value)
    assert "`fastqwen_fp8_input_gradient: fp8-1x128`" in text and "fastqwen_fp8: true" in text
    with pytest.raises(Exception, match="fastqwen_fp8_input_gradient"):  # pydantic: not one of the three
        settle(HOPPER, **LORA, fastqwen_fp8=True, fastqwen_fp8_input_gradient="fp16")


def test_mlp_chunk_tokens_reaches_the_settings_and_must_be_positive():
    assert settle()[0].mlp_chunk_tokens is None
    settings = settle(fastqwen_mlp_chunk_tokens=8192)[0]
    assert settings.mlp_chunk_tokens == 8192
    assert any(n.startswith("fastqwen_mlp_chunk_tokens: 8192 is at least the 4096 tokens a micro-batch holds")
               for n in settings.notes), settings.notes  # 2 x 2048-token rows: nothing would run in chunks
    assert not any("mlp_chunk" in n for n in settle(fastqwen_mlp_chunk_tokens=1024)[0].notes)
    with pytest.raises(Exception, match="fastqwen_mlp_chunk_tokens"):
        settle(fastqwen_mlp_chunk_tokens=0)


def test_checkpoint_offload_needs_checkpointing_and_refuses_a_second_offloader():
    assert settle(gradient_checkpointing=True)[0].checkpoint_offload == "auto"  # the default: decided at the forward
    assert settle(gradient_checkpointing=True, fastqwen_checkpoint_offload=False)[0].checkpoint_offload is False
    assert settle(gradient_checkpointing=False)[0].checkpoint_offload is False  # auto: nothing to move
    settings = settle(gradient_checkpointing=True, fastqwen_checkpoint_offload=True)[0]
    assert settings.checkpoint_offload and settings.checkpointing == "auto"  # auto sizes itself with it on
    with pytest.raises(ConfigError) as err:
        settle(gradient_checkpointing=False, fastqwen_checkpoint_offload=True)
    assert "without gradient checkpointing" in str(err.value) and "    gradient_checkpointing: true" in str(err.value)
    for cfg in ({"activation_offloading": True}, {"activation_offloading": "hidden_states"},
                {"gradient_checkpointing": "offload"}):
        with pytest.raises(ConfigError) as err:
            settle(**{"gradient_checkpointing": True, **cfg}, fastqwen_checkpoint_offload=True)
        assert "two offloaders would each copy them" in str(err.value), cfg
        assert "    activation_offloading: false" in str(err.value)
        settings = settle(**{"gradient_checkpointing": True, **cfg})[0]  # auto steps aside for Axolotl's, and says so
        assert settings.checkpoint_offload is False, cfg
        assert any(n.startswith("fastqwen_checkpoint_offload: auto is off: Axolotl's activation offloading")
                   for n in settings.notes), cfg
    with pytest.raises(Exception, match="fastqwen_checkpoint_offload"):
        settle(gradient_checkpointing=True, fastqwen_checkpoint_offload="always")


@pytest.mark.parametrize("env, cfg, why", [
    (Environment(2, 2, True), {}, "2 processes would each pin up to half the host's memory"),
    (GPU, {"torch_compile": True}, "torch_compile set: the offload is validated on one unsharded, uncompiled model"),
    (GPU, {"deepspeed": "zero2.json"}, "deepspeed set"),
])
def test_checkpoint_offload_auto_steps_aside_where_it_was_not_validated(env, cfg, why):
    settings = settle(env, gradient_checkpointing=True, **cfg)[0]
    assert settings.checkpoint_offload is False
    assert any(n.startswith("fastqwen_checkpoint_offload: auto is off: ") and why in n for n in settings.notes), \
        settings.notes
    if not cfg:  # `true` is the user's to set
        assert settle(env, gradient_checkpointing=True, fastqwen_checkpoint_offload=True)[0].checkpoint_offload


def test_axolotls_hidden_states_offload_composes_with_auto():
    """`activation_offloading: hidden_states` keeps gradient checkpointing and offloads the inputs of the
    layers whose flag is on: those auto recomputes. The others step auto aside as before."""
    settings = settle(gradient_checkpointing=True, activation_offloading="hidden_states")[0]
    assert settings.checkpointing == "auto"
    assert any(n.startswith("activation_offloading: hidden_states with fastqwen_checkpointing: auto")
               for n in settings.notes), settings.notes
    assert settle(gradient_checkpointing=True, activation_offloading="legacy")[0].checkpointing == "full"
