"""Real `axolotl train` runs (Axolotl 0.21 CLI, subprocess) of tiny models with the plugin.

Each run trains a few steps on CPU from the offline assets and the example YAML; assertions read
the plugin's report (`fastqwen_report.json`, written by its hooks) and the run's log.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from axolotl_runs import ROOT, fails, train, train_losses
from axolotl_runs import report as read_report

pytest.importorskip("axolotl")
pytestmark = [pytest.mark.axolotl, pytest.mark.slow]

ASSETS = ROOT / ".assets"


@pytest.fixture(scope="module", autouse=True)
def assets():
    from tiny_assets import write_assets

    write_assets(ASSETS)


def config(tmp_path, example="tiny-qwen3_5-cpu.yml", **overrides):
    cfg = yaml.safe_load((ROOT / "examples" / example).read_text())
    cfg.update(output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prepared"), max_steps=3,
               eval_steps=3, save_strategy="no")
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def report(tmp_path):
    return read_report(tmp_path / "out")


def test_class_form_patches_packs_and_reports(tmp_path):
    log = train(config(tmp_path))
    r = report(tmp_path)
    kernels, packing = r["kernels"], r["packing"]
    assert kernels["family"] == "qwen3_5"
    assert kernels["layers_patched"] == {"gated_deltanet": 3, "attention": 1}
    assert kernels["rms_norms_patched"] == 4 * 2 + 2 + 1  # each layer's two, the attention's q/k, the final
    assert kernels["mlps_patched"] == 4
    assert {op: v["backend"] for op, v in kernels["ops"].items()} == {
        "gated_delta_rule": "torch", "causal_conv": "torch", "gated_rmsnorm": "torch", "varlen_attention": "torch",
        "rms_norm": "torch", "swiglu": "torch", "linear_cross_entropy": "torch-chunked"}
    assert kernels["boundary_sources"] == ["collator"]
    # every training and evaluation batch had the one static shape
    assert kernels["batch_shapes"] == {"train": [[1, 1024]], "eval": [[1, 1024]]}
    assert packing["active"] and packing["row_shape"] == [1, 1024]
    assert r["checkpointing"] == {"mode": "off"}  # the tiny example trains without gradient checkpointing
    epoch = packing["epochs"][0]
    assert epoch["bins"] < epoch["padded_batches"] and epoch["over_lower_bound_pct"] <= 2.0
    assert "Gated DeltaNet + 1 attention layers patched" in log  # the load-time table is printed
    assert "fastqwen packing:" in log
    assert not any("LoRA" in note for note in kernels["notes"]), kernels["notes"]  # no autocast on CPU: no claim


def test_bare_module_name_works_once_on_qwen3_next(tmp_path):
    path = config(tmp_path, "tiny-qwen3_next-cpu.yml", plugins=["axolotl_fastqwen"])
    log = train(path)
    r = report(tmp_path)
    assert r["kernels"]["family"] == "qwen3_next"
    assert r["kernels"]["layers_patched"] == {"gated_deltanet": 3, "attention": 1}
    assert log.count("Gated DeltaNet + 1 attention layers patched") == 1  # hooks ran once, not per alias


def test_installed_but_not_named_does_nothing(tmp_path):
    # Stock Qwen3.5 layers crash on CPU when fla is importable (transformers picks it there), so
    # this run hides fla: what is checked is that our plugin leaves the run alone.
    shim = tmp_path / "no_fla"
    (shim / "fla").mkdir(parents=True)
    (shim / "fla" / "__init__.py").write_text("raise ImportError('fla hidden for a CPU stock run')\n")
    path = config(tmp_path, plugins=None, sample_packing=False, fastqwen_token_budget=1024)
    log = train(path, env_extra={"PYTHONPATH": str(shim)})
    assert not (tmp_path / "out" / "fastqwen_report.json").exists()
    assert "layers patched" not in log and "fastqwen packing" not in log
    assert "Plugin loaded successfully: axolotl_fastqwen.FastQwenPlugin" in log  # registered via entry point
    assert "fastqwen_token_budget are ignored" in log  # and says why the user's key does nothing


def test_a_contradiction_is_refused_at_config_load_in_one_paragraph_without_a_traceback(tmp_path):
    """`fastqwen_packing: true` insists on the packer, `streaming: true` makes it impossible: the two
    explicit choices contradict each other. The user sees the key, why and the YAML to paste, as the
    whole error, before any dataset or model work."""
    out = fails("preprocess", str(config(tmp_path, fastqwen_packing=True, streaming=True)))
    error = out[out.index("axolotl_fastqwen cannot train this config"):]
    assert error.splitlines()[0].endswith("`fastqwen_packing: true` with `streaming`"), error
    assert "needs every sample's length" in error and "    fastqwen_packing: false" in error
    assert "Traceback" not in out and "input_value" not in out
    assert "Tokenizing" not in out and "Loading model" not in out


def test_checkpointing_auto_runs_and_reports_why_it_recomputes_everything_on_cpu(tmp_path):
    """`fastqwen_checkpointing: auto` through Axolotl: the trainer callback is installed, builds
    its fitter after the Trainer turned checkpointing on, and the report says what it decided
    (a CPU has no peak-memory counters: every layer recomputed). The GPU fit is in
    test_gpu_kernels.py and the bench's path l."""
    path = config(tmp_path, gradient_checkpointing=True, fastqwen_checkpointing="auto")
    log = train(path)
    ckpt = report(tmp_path)["checkpointing"]
    assert ckpt["mode"] == "auto" and ckpt["phase"] == "off" and ckpt["layers"] == 4, ckpt
    assert "no CUDA device" in ckpt["summary"] and "fastqwen_checkpointing: auto: every layer recomputed" in log
    # after training, the report says why lean activations dropped nothing (not "no forward yet")
    shown = subprocess.run([sys.executable, "-m", "axolotl_fastqwen", "report", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert ("lean activations: on; dropped nothing: every layer was recomputed (every layer recomputed (no CUDA "
            "device") in shown.stdout, shown.stdout


def test_liger_plugin_beside_ours_runs_and_the_report_names_the_loss(tmp_path):
    """Axolotl's Liger plugin with its fused linear cross-entropy on a CPU run: Liger's Triton kernel
    cannot run here, so the plugin keeps the loss (the same definition) and says so; the losses
    equal those of the same run without Liger, step by step."""
    plain = tmp_path / "plain"
    plain.mkdir()
    reference = train_losses(train(config(plain)))
    path = config(tmp_path, plugins=["axolotl_fastqwen.FastQwenPlugin", "axolotl.integrations.liger.LigerPlugin"],
                  liger_fused_linear_cross_entropy=True)
    log = train(path)
    r = report(tmp_path)["kernels"]
    assert r["ops"]["linear_cross_entropy"]["backend"] == "torch-chunked"
    assert any(n.startswith("liger_fused_linear_cross_entropy: superseded") for n in r["notes"]), r["notes"]
    losses = train_losses(log)
    assert len(losses) == len(reference) == 3
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, reference)), (losses, reference)


def test_lora_on_the_routed_experts_runs_factored_with_the_losses_of_peft_merged(tmp_path):
    """`lora_target_parameters` on the tiny MoE's experts: with transformers' default experts the
    plugin runs `fastqwen_grouped` and peft's expert LoRA factored (the report says both); the
    reference run sets `experts_implementation: eager`, which the plugin leaves alone, so peft
    merges its expert stack and transformers loops over the experts. Same losses step by step (fp32:
    round-off only)."""
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    eager = tmp_path / "eager"
    eager.mkdir()
    reference = train_losses(train(config(eager, "tiny-qwen3_5_moe-cpu.yml", lora_target_parameters=experts,
                                          experts_implementation="eager")))
    assert report(eager)["kernels"]["experts"]["implementation"] == "eager"
    assert not any("runs factored" in n for n in report(eager)["kernels"]["notes"])
    losses = train_losses(train(config(tmp_path, "tiny-qwen3_5_moe-cpu.yml", lora_target_parameters=experts)))
    r = report(tmp_path)["kernels"]
    assert r["experts"]["implementation"] == "fastqwen_grouped", r["experts"]
    assert any("runs factored" in n and "(down_proj, gate_up_proj)" in n for n in r["notes"]), r["notes"]
    assert len(losses) == len(reference) == 3
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, reference)), (losses, reference)


def test_liger_kernels_that_cannot_run_on_cpu_fail_before_the_model_loads(tmp_path):
    path = config(tmp_path, plugins=["axolotl_fastqwen.FastQwenPlugin", "axolotl.integrations.liger.LigerPlugin"],
                  liger_rms_norm=True, liger_glu_activation=True)
    out = fails("train", str(path), "--launcher", "python")
    assert "`liger_rms_norm: true`, `liger_glu_activation: true` run Triton kernels, which need a CUDA GPU" in out
    assert "Set them false here" in out


def test_a_misspelt_plugin_key_fails_at_config_load(tmp_path):
    out = fails("preprocess", str(config(tmp_path, fastqwen_pakcing=False)))
    assert ("axolotl_fastqwen cannot train this config: unknown option `fastqwen_pakcing` (did you mean "
            "`fastqwen_packing`?)") in out and "Traceback" not in out
    assert "Tokenizing" not in out and "Loading model" not in out


def test_an_unsupported_model_is_refused_at_config_load(tmp_path):
    """A non-hybrid checkpoint (Qwen3) in a config that names the plugin: refused from its config.json
    before any dataset work, not after tokenization."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    model_dir = tmp_path / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, vocab_size=512)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(ASSETS / "tokenizer").save_pretrained(model_dir)
    out = fails("preprocess", str(config(tmp_path, base_model=str(model_dir))))
    assert "axolotl_fastqwen supports model types" in out and "'qwen3'" in out
    assert "Tokenizing" not in out and "Loading model" not in out


@pytest.mark.parametrize("mode", ["truncate", "split"])
def test_overlong_samples_are_cut_counted_and_reported(tmp_path, mode):
    """A 256-token budget under sequence_len 512: the chat samples between 256 and 512 tokens are
    overlong. Both modes train, and the report counts what was cut (the planner alone would say 0,
    since it sees the samples after cutting)."""
    path = config(tmp_path, fastqwen_token_budget=256, fastqwen_overlong=mode)
    log = train(path)
    packing = report(tmp_path)["packing"]
    cut = packing["overlong_train"]
    assert cut["mode"] == mode and cut["overlong_samples"] > 0 and cut["tokens_in_overlong"] > 256 * cut["overlong_samples"]
    if mode == "truncate":
        assert cut["tokens_dropped"] == cut["tokens_in_overlong"] - 256 * cut["overlong_samples"] > 0
        assert f"truncated: {cut['tokens_dropped']:,} tokens dropped" in log
    else:
        assert cut["pieces"] >= 2 * cut["overlong_samples"]
        assert f"split into {cut['pieces']} pieces" in log
    assert report(tmp_path)["kernels"]["batch_shapes"]["train"] == [[1, 256]]
    shown = subprocess.run([sys.executable, "-m", "axolotl_fastqwen", "report", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "overlong (train):" in shown.stdout, shown.stdout + shown.stderr


def test_overlong_error_names_the_rows_and_lengths(tmp_path):
    out = fails("train", str(config(tmp_path, fastqwen_token_budget=256)), "--launcher", "python")
    assert "samples are longer than the token budget of 256 tokens: the longest: dataset index" in out
    assert "begins '" in out and "fastqwen_overlong: truncate|split" in out


def test_report_command_is_fast_and_says_where_it_looked(tmp_path):
    import time

    path = config(tmp_path)
    started = time.perf_counter()
    shown = subprocess.run([sys.executable, "-m", "axolotl_fastqwen", "report", str(path)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - started
    assert shown.returncode == 1
    assert f"no fastqwen_report.json in {tmp_path / 'out'}" in shown.stdout
    assert "bitsandbytes" not in shown.stdout + shown.stderr
    assert seconds < 5, seconds  # no torch, transformers or Axolotl import (0.1 s here; 10 s before)


def test_kernel_preference_reaches_kernel_selection_and_a_refusal_is_reported(tmp_path):
    """`fastqwen_kernel_preference` goes through Axolotl's schema to the plugin's kernel choice:
    FlashQLA asked for on a CPU is refused with its reason, training runs on the reference."""
    train(config(tmp_path, fastqwen_kernel_preference={"gated_delta_rule": "flash-qla"}))
    gdn = report(tmp_path)["kernels"]["ops"]["gated_delta_rule"]
    assert gdn["backend"] == "torch", gdn
    # tried first because it was preferred (without the preference fla comes first)
    assert gdn["rejected"][0] == "flash-qla: needs a CUDA device (model is on cpu)", gdn


def test_a_kernel_preference_for_an_unknown_op_fails_at_config_load(tmp_path):
    out = fails("preprocess", str(config(tmp_path, fastqwen_kernel_preference={"gdn": "flash-qla"})))
    assert "fastqwen_kernel_preference: unknown op(s) ['gdn']" in out and "Loading model" not in out


def test_lean_activations_train_with_the_losses_of_a_run_without_them(tmp_path):
    """Lean activations through Axolotl, on by default (the key unset), no checkpointing (every layer
    keeps its activations): the same per-step losses as `fastqwen_lean_activations: false`, to the
    printed digit (the gradients are the same bits: test_lean_activations.py), and the report says
    what was dropped."""
    plain, lean = tmp_path / "plain", tmp_path / "lean"
    plain.mkdir(), lean.mkdir()
    reference = train_losses(train(config(plain, fastqwen_lean_activations=False)))
    log = train(config(lean))
    losses = train_losses(log)
    assert len(losses) == len(reference) == 3 and losses == reference, (losses, reference)
    dropped = report(lean)["kernels"]["lean_activations"]
    # all 16 (4 a layer: two norms, the gated norm or output gate, the MLP product): Axolotl calls peft's
    # `enable_input_require_grads`, so even the first norm saves its input (test_lean_activations.py: 15 without)
    assert dropped["lean_layers_last_forward"] == 4 and dropped["outputs_dropped_per_forward"] == 16, dropped
    assert dropped["saves_kept"] == {}, dropped
    assert "lean activations: on; no layer that keeps its activations has run a training forward yet" in log


def test_mlp_chunks_train_with_the_losses_of_a_run_without_them(tmp_path):
    """`fastqwen_mlp_chunk_tokens: 256` through Axolotl on 1,024-token rows: every dense MLP in four
    chunks, each recomputed in backward; the per-step losses of the run without it (the MLP is per
    token: test_mlp_chunks.py holds the gradients to 1e-6), and the report counts the chunked forwards."""
    plain, chunked = tmp_path / "plain", tmp_path / "chunked"
    plain.mkdir(), chunked.mkdir()
    reference = train_losses(train(config(plain)))
    log = train(config(chunked, fastqwen_mlp_chunk_tokens=256))
    losses = train_losses(log)
    assert len(losses) == len(reference) == 3
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(losses, reference)), (losses, reference)
    chunks = report(chunked)["kernels"]["mlp_chunks"]
    assert chunks["mlps"] == 4 and chunks["chunk_tokens"] == 256 and chunks["chunked_forwards"] >= 4 * 3
    assert "mlp chunks: 4 dense MLPs run rows of more than 256 tokens" in log
    assert report(plain)["kernels"]["mlp_chunks"] is None


def test_checkpoint_offload_trains_with_the_losses_of_a_run_without_it(tmp_path):
    """`fastqwen_checkpoint_offload: true` with gradient checkpointing, through Axolotl: every
    recomputed layer's input goes to a host buffer and comes back for its recompute
    (tests/offload_on_cpu.py lets the offload take the CPU's tensors); the per-step losses are the
    run's without the offload, to the printed digit (the offload copies values: test_checkpoint_offload.py
    holds the gradients bit for bit), and the report counts what moved."""
    tests = str(ROOT / "tests")
    plain, offload = tmp_path / "plain", tmp_path / "offload"
    plain.mkdir(), offload.mkdir()
    plugins = ["offload_on_cpu.OffloadOnCpu", "axolotl_fastqwen.FastQwenPlugin"]
    env = {"env_extra": {"PYTHONPATH": tests}}
    reference = train_losses(train(config(plain, plugins=plugins, gradient_checkpointing=True), **env))
    log = train(config(offload, plugins=plugins, gradient_checkpointing=True, fastqwen_checkpoint_offload=True), **env)
    losses = train_losses(log)
    assert len(losses) == len(reference) == 3 and losses == reference, (losses, reference)
    moved = report(offload)["kernels"]["checkpoint_offload"]
    assert moved["last_forward_inputs"] == 4 and moved["restored"] >= 4 * 3, moved  # full recompute on a CPU
    assert moved["prefetched"] == moved["restored"] - 3, moved  # each backward's first restore has no one ahead
    assert "checkpoint offload: on (recomputed layers' inputs to pinned host memory" in log  # the load report
    # the default, auto, on a CPU: no device memory to crowd, nothing moved
    left = report(plain)["kernels"]["checkpoint_offload"]
    assert left["mode"] == "auto" and not left["active"] and left["offloaded_inputs"] == 0, left
    assert left["why"] == "off: no device memory to spare on cpu", left


def test_checkpoint_offload_auto_turns_on_where_the_inputs_would_crowd_the_device(tmp_path):
    """The default `fastqwen_checkpoint_offload: auto` through Axolotl, on a CPU made to read as a
    device of 1 byte (tests/offload_on_cpu.py): the first training forward's inputs cannot fit, so
    the offload turns on there and the run trains with the losses of a run without it."""
    tests = str(ROOT / "tests")
    plain, auto = tmp_path / "plain", tmp_path / "auto"
    plain.mkdir(), auto.mkdir()
    plugins = ["offload_on_cpu.OffloadOnCpu", "axolotl_fastqwen.FastQwenPlugin"]
    reference = train_losses(train(config(plain, plugins=plugins, gradient_checkpointing=True,
                                          fastqwen_checkpoint_offload=False), env_extra={"PYTHONPATH": tests}))
    log = train(config(auto, plugins=plugins, gradient_checkpointing=True),
                env_extra={"PYTHONPATH": tests, "FASTQWEN_TEST_DEVICE_BYTES": "1"})
    assert train_losses(log) == reference and len(reference) == 3, (train_losses(log), reference)
    moved = report(auto)["kernels"]["checkpoint_offload"]
    assert moved["mode"] == "auto" and moved["active"] and moved["last_forward_inputs"] == 4, moved
    assert moved["why"].startswith("on: 4 recomputed layers' inputs"), moved
    assert report(plain)["kernels"]["checkpoint_offload"] is None


def test_checkpoint_offload_with_axolotls_offloader_is_refused_at_config_load(tmp_path):
    out = fails("preprocess", str(config(tmp_path, gradient_checkpointing=True, activation_offloading=True,
                                         fastqwen_checkpoint_offload=True)))
    error = out[out.index("axolotl_fastqwen cannot train this config"):]
    assert error.splitlines()[0].endswith("`fastqwen_checkpoint_offload: true` with `activation_offloading: True`"), error
    assert "    activation_offloading: false" in error and "Traceback" not in out


def test_fp8_on_a_machine_without_fp8_tensor_cores_is_refused_at_config_load(tmp_path):
    """`fastqwen_fp8: true` on this CPU machine: the key, why, and the line to paste, before any
    dataset or model work (on a Hopper GPU the same YAML trains: tests/test_gpu_kernels.py)."""
    out = fails("preprocess", str(config(tmp_path, fastqwen_fp8=True)))
    error = out[out.index("axolotl_fastqwen cannot train this config"):]
    assert error.splitlines()[0].endswith("`fastqwen_fp8: true`"), error
    assert "no CUDA GPU here: FP8 tensor cores with row-wise scaling exist on Hopper" in error
    assert "    fastqwen_fp8: false" in error and "Traceback" not in out and "Tokenizing" not in out


def test_fp8_trains_through_axolotl_with_the_losses_of_bf16_and_saves_a_plain_adapter(tmp_path):
    """`fastqwen_fp8: true` through the whole `axolotl train` path, on the CPU's FP8 GEMM
    (tests/fp8_on_cpu.py stands in for the Hopper check and the size floor): every projection of the
    toy is quantized after peft wrapped it, Axolotl's trainer runs, the per-step losses stay within 2%
    of the same run without FP8 (measured 0.2% on the same toy in test_fp8_linear.py: the loss is well
    conditioned, its gradients at toy size are not), and the saved adapter holds LoRA weights only, in
    the adapter's own dtype."""
    from safetensors.torch import load_file

    tests = str(ROOT / "tests")
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    plain.mkdir(), fp8.mkdir()
    plugins = ["fp8_on_cpu.Fp8OnCpu", "axolotl_fastqwen.FastQwenPlugin"]
    env = {"env_extra": {"PYTHONPATH": tests}}
    reference = train_losses(train(config(plain, plugins=plugins), **env))
    log = train(config(fp8, plugins=plugins, fastqwen_fp8=True), **env)
    losses = train_losses(log)
    assert len(losses) == len(reference) == 3
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, reference)), (losses, reference)
    assert losses != reference  # FP8 did run: its rounding shows in the printed losses
    got = report(fp8)["kernels"]["fp8"]
    assert got["modules_fp8"] > 0 and got["host_bytes"] == got["bf16_bytes_freed"] > 0
    assert all(row["fp8"] and row["why"].startswith("cpu: not timed") for row in got["projections"].values())
    assert "fastqwen_fp8: true: the decoder's large frozen projections on FP8 GEMMs" in log
    assert "fp8 frozen GEMMs:" in log and report(plain)["kernels"]["fp8"] is None
    adapter = load_file(str(fp8 / "out" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in key for key in adapter), sorted(adapter)[:5]
    assert {str(t.dtype) for t in adapter.values()} == {"torch.float32"}  # the adapters' own dtype here, no e4m3
    # fastqwen_fp8_input_gradient reaches the patch through Axolotl: FP8 in the forward only
    forward_only = tmp_path / "forward_only"
    forward_only.mkdir()
    log = train(config(forward_only, plugins=plugins, fastqwen_fp8=True, fastqwen_fp8_input_gradient="bf16"), **env)
    assert report(forward_only)["kernels"]["fp8"]["input_gradient"] == "bf16" and got["input_gradient"] == "fp8"
    assert "input gradients in bf16 on the dequantized weights" in log
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(train_losses(log), reference))


def test_bf16_autocast_with_the_adapters_cast_once_a_forward_gives_the_per_layer_losses(tmp_path):
    """`bf16: true` on a CPU (tests/bf16_on_cpu.py): Axolotl's Trainer under bf16 autocast with peft's fp32 adapters, gradient
    accumulation over two micro-batches and (non-reentrant) checkpointing: the fused LoRA layers read
    adapters cast once a forward (`patching/lora_weight_copies.py`), refreshed every micro-batch and
    never read after the optimizer's step. lora_alpha = 2r, so the per-step losses are those of the
    per-layer casts (tests/no_weight_copies.py) to the printed digit, and the report says it was on."""
    tests = str(ROOT / "tests")
    plain, copies = tmp_path / "plain", tmp_path / "copies"
    plain.mkdir(), copies.mkdir()
    env = {"env_extra": {"PYTHONPATH": tests}}
    # SGD: Adam's step does not see a gradient's scale (a B gradient off by s would train the same)
    common = dict(bf16=True, gradient_checkpointing=True, gradient_accumulation_steps=2, micro_batch_size=1,
                  optimizer="sgd", learning_rate=0.5)
    ours = ["bf16_on_cpu.Bf16OnCpu", "axolotl_fastqwen.FastQwenPlugin"]
    reference = train_losses(train(config(plain, plugins=["no_weight_copies.NoWeightCopies", *ours], **common), **env))
    losses = train_losses(train(config(copies, plugins=ours, **common), **env))
    assert len(losses) == len(reference) == 3 and losses == reference, (losses, reference)
    fused = report(copies)["kernels"]["fused_lora"]
    state = fused["weight_copies"]
    assert state["state"] == "on" and state["layers"] == fused["layers"] > 0 and state["forwards"] == 6, fused
    assert report(plain)["kernels"]["fused_lora"]["weight_copies"]["state"] == "off: the test's control"


def test_moe_cuda_graphs_train_through_axolotl_with_the_losses_of_a_run_without_them(tmp_path):
    """`fastqwen_moe_cuda_graphs: true` on the tiny MoE under `bf16: true` (tests/bf16_on_cpu.py), two
    micro-batches a step and an eval, with the graphs stood in by eager calls (tests/moe_graphs_on_cpu.py: a
    CUDA graph needs a GPU; the capture itself is `test_gpu_kernels.py::test_moe_cuda_graphs_*`): the
    Trainer's forwards warm each block up, capture it and replay it, its backwards hand the gradients back,
    its eval runs eagerly. The stand-in runs the blocks' own ops in their order, so every training and eval
    loss is the run without the key's to the printed digit; the report counts the replays."""
    tests = str(ROOT / "tests")
    off, on = tmp_path / "off", tmp_path / "on"
    off.mkdir(), on.mkdir()
    env = {"env_extra": {"PYTHONPATH": tests}}
    common = dict(bf16=True, gradient_accumulation_steps=2, micro_batch_size=1,
                  plugins=["bf16_on_cpu.Bf16OnCpu", "moe_graphs_on_cpu.MoeGraphsOnCpu", "axolotl_fastqwen.FastQwenPlugin"])
    reference = train(config(off, "tiny-qwen3_5_moe-cpu.yml", **common), **env)
    log = train(config(on, "tiny-qwen3_5_moe-cpu.yml", fastqwen_moe_cuda_graphs=True, **common), **env)
    losses = train_losses(log)
    eval_losses = re.findall(r"'eval_loss': '?([0-9.]+)", log)
    assert len(losses) == 3 and losses == train_losses(reference), (losses, train_losses(reference))
    assert eval_losses and eval_losses == re.findall(r"'eval_loss': '?([0-9.]+)", reference)
    graphs = report(on)["kernels"]["moe_cuda_graphs"]
    blocks = graphs["blocks"]
    assert blocks > 0 and graphs["captured"] == graphs["captures"] == blocks, graphs
    assert graphs["replays"] == (3 * 2 - 2) * blocks, graphs  # 6 training forwards, the first 2 warm up
    assert graphs["eager_calls"]["warm-up"] == 2 * blocks and graphs["eager_calls"]["no gradients (eval)"] > 0
    assert graphs["failed"] is None
    assert report(off)["kernels"]["moe_cuda_graphs"] is None
