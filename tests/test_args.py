"""The plugin's config keys: every contradiction fails naming the key and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from axolotl_fastqwen.args import FastQwenArgs, lean_activations_setting, token_budget


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"fastqwen_token_budget": 1000}, "fastqwen_token_budget must be a positive multiple of 64, got 1000; use e.g. fastqwen_token_budget: 1024"),
        ({"fastqwen_token_budget": 0}, "got 0; use e.g. fastqwen_token_budget: 64"),
        ({"fastqwen_token_budget": -128}, "got -128"),
        ({"sample_packing": True}, "`sample_packing: True`"),
        ({"batch_flattening": True}, "`batch_flattening: True`"),
        ({"eval_sample_packing": True}, "`eval_sample_packing: True`"),
        ({"pretraining_dataset": [{"path": "x"}]}, "streaming pretraining data"),
        ({"rl": "dpo"}, "`rl: dpo`"),
        ({"group_by_length": True}, "length-grouped"),
        ({"context_parallel_size": 2}, "context_parallel_size > 1"),
        ({"fastqwen_kernels": "fast"}, "fastqwen_kernels"),
        ({"fastqwen_overlong": "drop"}, "fastqwen_overlong"),
        ({"fastqwen_kernel_preference": {"gdn": "flash-qla"}},
         "fastqwen_kernel_preference: unknown op(s) ['gdn']; the ops are gated_delta_rule, causal_conv"),
        ({"fastqwen_lean_activations": True, "fsdp_config": {"fsdp_version": 2}},
         "fastqwen_lean_activations cannot be used with `fsdp_config`"),
        ({"fastqwen_lean_activations": True, "torch_compile": True, "deepspeed": "zero3.json"},
         "cannot be used with `deepspeed`, `torch_compile`: sharded weights"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(data, message):
    with pytest.raises(ValidationError) as err:
        FastQwenArgs.model_validate(data)
    assert message in str(err.value)
    if "fastqwen_packing" not in data and any(k in data for k in ("sample_packing", "rl", "batch_flattening")):
        assert "set `fastqwen_packing: false`" in str(err.value)


def test_lean_activations_default_on_and_steps_aside_for_sharding_compile_and_full_checkpointing():
    """Unset, the key turns lean activations on, except where they cannot run (sharding, compile) or
    have nothing to drop (every layer recomputed), each said in the report; set, it is obeyed (and
    `true` under sharding or compile fails at load, above)."""
    assert FastQwenArgs.model_validate({}).fastqwen_lean_activations is None
    FastQwenArgs.model_validate({"fastqwen_lean_activations": True, "torch_compile": False, "fsdp_config": {}})
    FastQwenArgs.model_validate({"fastqwen_lean_activations": False, "torch_compile": True})  # off: no clash
    assert lean_activations_setting({}) == (True, None)
    assert lean_activations_setting({"torch_compile": False, "fsdp_config": {}}) == (True, None)
    assert lean_activations_setting({"gradient_checkpointing": True, "fastqwen_checkpointing": "auto"}) == (True, None)
    assert lean_activations_setting({"fastqwen_lean_activations": False}) == (False, None)
    on, why = lean_activations_setting({"fastqwen_lean_activations": True, "gradient_checkpointing": True})
    assert on and why.startswith("fastqwen_lean_activations drops nothing here"), why
    on, why = lean_activations_setting({"fsdp_config": {"fsdp_version": 2}, "torch_compile": True})
    assert not on and why.startswith("lean activations off (default): fsdp_config, torch_compile set"), why
    on, why = lean_activations_setting({"gradient_checkpointing": True})
    assert not on and "gradient_checkpointing recomputes every layer" in why, why


def test_packing_off_allows_axolotl_packing():
    FastQwenArgs.model_validate({"fastqwen_packing": False, "sample_packing": True})


def test_defaults_and_budget():
    args = FastQwenArgs.model_validate({})
    assert (args.fastqwen_packing, args.fastqwen_kernels, args.fastqwen_overlong, args.fastqwen_fused_ce) == (
        True, "auto", "error", True)
    assert token_budget({"sequence_len": 500, "micro_batch_size": 3}) == 1536  # 1500 rounded up to 64
    assert token_budget({"fastqwen_token_budget": 4096, "sequence_len": 512}) == 4096


def test_a_misspelt_key_fails_naming_the_closest_valid_one():
    with pytest.raises(ValidationError) as err:
        FastQwenArgs.model_validate({"fastqwen_pakcing": False, "fastqwen_token_budgett": 1024})
    message = str(err.value)
    assert "`fastqwen_pakcing` (did you mean `fastqwen_packing`?)" in message
    assert "`fastqwen_token_budgett` (did you mean `fastqwen_token_budget`?)" in message
    FastQwenArgs.model_validate({"fastqwen_packing": False, "unrelated_key": 1})  # others are Axolotl's business


def test_kernel_preference_names_known_ops():
    args = FastQwenArgs.model_validate({"fastqwen_kernel_preference": {"gated_delta_rule": "flash-qla"}})
    assert args.fastqwen_kernel_preference == {"gated_delta_rule": "flash-qla"}
    assert FastQwenArgs.model_validate({}).fastqwen_kernel_preference is None
