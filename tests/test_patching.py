"""Patched vs stock Qwen hybrid models on CPU, fp32: every family, LoRA, checkpointing, packing.

Tolerance: both sides run the same fp32 math in a different order (chunked vs stock loops,
per-sequence vs masked attention), so they agree to fp32 round-off: relative error <= 1e-5 on
logits and on the concatenation of all parameter gradients ("global"), <= 1e-4 on any single
gradient tensor (a tiny tensor such as dt_bias sums few terms, so its relative error is noisier).
A leak across packed sequences is O(1e-1) (asserted below so these tests can fail).
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.boundaries import BoundaryError
from axolotl_fastqwen.families import UnsupportedModelError
from axolotl_fastqwen.kernel_choice import KernelUnavailableError
from axolotl_fastqwen.packing import PackedCollator
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from tiny_assets import build_tiny_model

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
LORA_TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                "up_proj", "down_proj"]
TOL, TENSOR_TOL = 1e-5, 1e-4
LENGTHS = [37, 1, 70, 20]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def sequences(vocab, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(ours, stock):
    assert ours.keys() == stock.keys()
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    assert rel(flat(ours), flat(stock)) <= TOL
    worst = max(stock, key=lambda k: rel(ours[k], stock[k]))
    assert rel(ours[worst], stock[worst]) <= TENSOR_TOL, worst


def loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), grads(model)


def model_for(family, **kw):
    model = build_tiny_model(family, **kw)
    model.config._attn_implementation = "sdpa"
    return model.train()


@pytest.mark.parametrize("family", FAMILIES)
def test_unpacked_batch_matches_stock(family):
    model = model_for(family)
    ids = torch.stack(sequences(model.config.vocab_size, [48, 48]))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # one right-padded row
    labels = ids.masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with stock_torch_kernels(family):
        stock_logits = model(input_ids=ids, attention_mask=mask).logits.detach()
        stock_loss, stock_grads = loss_and_grads(model, **batch)
    report = patch_model(model)
    assert report.gated_deltanet_layers == 3 and report.attention_layers == 1
    assert report.fused_cross_entropy == "torch-chunked"
    logits = model(input_ids=ids, attention_mask=mask).logits.detach()
    loss, ours = loss_and_grads(model, **batch)
    assert rel(logits[mask.bool()], stock_logits[mask.bool()]) <= TOL
    assert abs(float(loss - stock_loss)) <= TOL * float(stock_loss)
    assert_grads_close(ours, stock_grads)


def packed_batch(seqs, budget=256):
    return PackedCollator(budget)([{"input_ids": s.tolist(), "labels": s.tolist()} for s in seqs])


def alone_loss_and_grads(model, seqs, family):
    """Stock model, each sequence alone; loss summed over sequences (num_items_in_batch=1)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    with stock_torch_kernels(family):
        for s in seqs:
            out = model(input_ids=s[None], labels=s[None], num_items_in_batch=torch.tensor(1))
            out.loss.backward()
            total += float(out.loss.detach())
    return total, grads(model)


def assert_packed_training_matches(model, batch, alone_loss, alone_grads):
    """The packed row's summed loss and its gradients equal the per-sequence ones."""
    loss, packed_grads = loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(1))
    assert abs(float(loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(packed_grads, alone_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_each_sequence_alone(family):
    model = model_for(family)
    seqs = sequences(model.config.vocab_size)
    with stock_torch_kernels(family):
        alone_logits = torch.cat([model(input_ids=s[None]).logits[0].detach() for s in seqs])
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, family)
    patch_model(model)
    batch = packed_batch(seqs)
    n = sum(LENGTHS)
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    packed_logits = model(**no_labels).logits[0, :n].detach()
    assert rel(packed_logits, alone_logits) <= TOL
    assert_packed_training_matches(model, batch, alone_loss, alone_grads)


def test_stock_model_leaks_across_packed_sequences():
    """The failure the patch exists for: stock layers on a packed row with only position_ids."""
    model = model_for("qwen3_5")
    seqs = sequences(model.config.vocab_size)
    packed = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with stock_torch_kernels("qwen3_5"):
        alone = torch.cat([model(input_ids=s[None]).logits[0].detach() for s in seqs])
        leaky = model(input_ids=packed, position_ids=pos).logits[0].detach()
    later = slice(LENGTHS[0] + LENGTHS[1], None)
    assert rel(leaky[later], alone[later]) > 1e-2


def test_lora_wrapped_projections_train_identically():
    from peft import LoraConfig, get_peft_model

    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    seqs = sequences(model.config.vocab_size)
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, "qwen3_5")
    assert any("in_proj_qkv.lora_A" in k for k in alone_grads)
    report = patch_model(model)
    assert report.gated_deltanet_layers == 3
    assert_packed_training_matches(model, packed_batch(seqs), alone_loss, alone_grads)


def test_bf16_autocast_training_is_as_accurate_as_stock():
    """Axolotl trains `bf16: true` under Accelerate's autocast with peft's fp32 adapters.

    Tolerances from first principles, with u = 2^-8 = 3.9e-3 (bf16's unit roundoff: 8 significant
    bits). Under autocast every matmul rounds its operands to bf16; norms, gates, the recurrence
    state, softmax and the loss stay fp32, in the patched path as in stock.
    * The loss is a mean of ~128 per-token log-probabilities, each off by O(u) relative with
      independent signs: within 2.5 u of the fp32 value, for stock and for the patched row.
    * A gradient is a sum over tokens of products that cancel (this random tiny model's gradients
      are small against their terms), so its bf16 error is u times a cancellation factor that
      depends on the draw of the weights: stock lands 0.09 to 0.38 from the fp32 gradient over four
      LoRA seeds. The patched row performs the same roundings (the same bf16 matmuls, the same fp32
      stages) in another order: its error is a draw from the same distribution as stock's, so the
      two are of the same size, whatever the cancellation; measured ratios 0.74, 1.16, 0.83, 0.98
      (seeds 0-3). It must stay within 1.5x stock's; math done at a lower precision than stock's
      (e.g. the recurrence or the loss in bf16) multiplies the error by 2^8 / 2^3 or more.
    """
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the adapters' random init (init_lora_weights=False): a fixed draw
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                             init_lora_weights=False))
    seqs = sequences(model.config.vocab_size)
    truth_loss, truth = alone_loss_and_grads(model, seqs, "qwen3_5")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock_loss, stock = alone_loss_and_grads(model, seqs, "qwen3_5")
    patch_model(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**packed_batch(seqs), num_items_in_batch=torch.tensor(1))
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    ours = grads(model)
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    u = 2.0**-8
    assert abs(float(out.loss) - truth_loss) <= 2.5 * u * truth_loss
    assert abs(stock_loss - truth_loss) <= 2.5 * u * truth_loss
    ours_err, stock_err = rel(flat(ours), flat(truth)), rel(flat(stock), flat(truth))
    assert ours_err <= 1.5 * stock_err, (ours_err, stock_err)


def test_lora_input_upcast_is_skipped_only_under_autocast_and_changes_no_bit(monkeypatch):
    """bf16 model, peft's default fp32 adapters: under autocast the LoRA layers skip their fp32
    input copy (autocast recasts to bf16 anyway), giving bitwise the same loss and gradients; without
    autocast they keep it (fp32 weights need it); unpatching leaves peft's setting as it was."""
    from peft import LoraConfig, get_peft_model

    from axolotl_fastqwen.patching import lora_input_cast as adapters

    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model_for("qwen3_5").to(torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    layers = adapters.plain_lora_layers(model)
    assert len(layers) == 25 and {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    seen = []
    layers[1].register_forward_pre_hook(lambda m, a: seen.append(m.cast_input_dtype_enabled))
    batch = packed_batch(sequences(model.config.vocab_size))

    def step(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), grads(model)

    report = patch_model(model, fused_lora=False)  # peft's own forward, the one that reads the setting
    fast_loss, fast_grads = step(autocast=True)
    assert seen[-1] is False and any("25 peft LoRA layers skip" in n for n in report.to_dict()["notes"])
    step(autocast=False)
    assert seen[-1] is True
    monkeypatch.setattr(adapters.LoraInputCast, "update", lambda self, device_type: None)  # peft as it is
    slow_loss, slow_grads = step(autocast=True)
    assert seen[-1] is True
    assert torch.equal(fast_loss, slow_loss)
    assert all(torch.equal(fast_grads[k], slow_grads[k]) for k in slow_grads)
    unpatch_model(model)
    assert all(m.cast_input_dtype_enabled is True for m in layers)


def test_gradient_checkpointing_gives_the_same_gradients():
    """Both sides checkpointed (non-reentrant, as Axolotl sets it): the patched packed row against
    stock on each sequence alone, so a recompute that saw other boundaries would show."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                             init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.get_base_model().model.gradient_checkpointing
    seqs = sequences(model.config.vocab_size)
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, "qwen3_5")
    patch_model(model)
    assert_packed_training_matches(model, packed_batch(seqs), alone_loss, alone_grads)


def test_gradient_accumulation_equals_one_large_batch():
    """`gradient_accumulation_steps: 2` as the Trainer runs it: two packed rows, each forward given
    the window's `num_items_in_batch` (its count of trainable tokens over both), gradients summed:
    the loss and the gradients of one large batch (here: every sequence alone through stock,
    summed, over the same count)."""
    model = model_for("qwen3_5")
    seqs = sequences(model.config.vocab_size, [37, 1, 70, 20, 55, 12])
    rows = [packed_batch(seqs[:3], budget=128), packed_batch(seqs[3:], budget=128)]
    count = sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)  # the Trainer counts shifted labels
    total = torch.tensor(count)
    model.zero_grad(set_to_none=True)
    stock_loss = 0.0
    with stock_torch_kernels("qwen3_5"):
        for s in seqs:
            out = model(input_ids=s[None], labels=s[None], num_items_in_batch=total)
            out.loss.backward()
            stock_loss += float(out.loss)
        stock_grads = grads(model)
    patch_model(model)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for row in rows:
        out = model(**row, num_items_in_batch=total)
        out.loss.backward()
        loss += float(out.loss)
    assert abs(loss - stock_loss) <= TOL * stock_loss
    assert_grads_close(grads(model), stock_grads)


def test_unpatch_restores_the_stock_forward_exactly():
    model = model_for("qwen3_next")
    ids = sequences(model.config.vocab_size, [30])[0][None]
    with stock_torch_kernels():
        before = model(input_ids=ids).logits
    patch_model(model)
    assert any("forward" in m.__dict__ for m in model.modules())
    unpatch_model(model)
    assert not any("forward" in m.__dict__ or "_fastqwen" in m.__dict__ for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())
    with stock_torch_kernels():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_saved_adapter_reloads_in_plain_peft_with_the_trained_weights(tmp_path):
    """Train a few steps with the plugin, save; load into a fresh stock model with plain peft: the
    same tensors by value, and the same logits as the trained (patched) model gives."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj"])
    model = get_peft_model(model_for("qwen3_5"), config)
    patch_model(model)
    seqs = sequences(model.config.vocab_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(**packed_batch(seqs)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path / "adapter")
    trained = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert trained and any(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)  # it trained
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(trained)

    reloaded = PeftModel.from_pretrained(model_for("qwen3_5"), tmp_path / "adapter").eval()
    state = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert sorted(state) == sorted(trained)
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    ids = torch.cat(seqs[:1])[None]
    with stock_torch_kernels("qwen3_5"), torch.no_grad():
        stock_logits = reloaded(input_ids=ids).logits
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert rel(ours, stock_logits) <= TOL


@pytest.mark.parametrize("family", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vision_language_model_text_path_trains_exactly(family):
    """`*ForConditionalGeneration` (what Axolotl loads from the published Qwen3.5 checkpoints) on
    text: packed logits, loss and every gradient equal stock on each sequence alone."""
    model = model_for(family)
    text = "qwen3_5" if family == "qwen3_5_vl" else "qwen3_5_moe"
    seqs = sequences(model.config.text_config.vocab_size, [20, 31, 9])
    with stock_torch_kernels(text):
        alone = torch.cat([model(input_ids=s[None]).logits[0].detach() for s in seqs])
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, text)
    report = patch_model(model)
    assert report.gated_deltanet_layers == 3 and report.fused_cross_entropy == "torch-chunked"
    batch = packed_batch(seqs, budget=64)
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert rel(model(**no_labels).logits[0, :60].detach(), alone) <= TOL
    assert_packed_training_matches(model, batch, alone_loss, alone_grads)


def test_position_ids_that_contradict_the_boundaries_are_refused():
    model = model_for("qwen3_5")
    patch_model(model)
    batch = packed_batch(sequences(model.config.vocab_size))
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]  # never restarts
    with pytest.raises(BoundaryError, match="restart at 0"):
        model(**batch)


def test_attention_mask_with_zeros_on_a_packed_row_is_refused():
    model = model_for("qwen3_5")
    patch_model(model)
    batch = packed_batch(sequences(model.config.vocab_size))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, -10:] = 0
    with pytest.raises(BoundaryError, match="Drop attention_mask"):
        model(**batch)


def test_unknown_gated_deltanet_variant_is_refused():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    class CustomGatedDeltaNet(mq.Qwen3_5GatedDeltaNet):
        pass

    model = model_for("qwen3_5")
    layer = model.model.layers[0]
    layer.linear_attn.__class__ = CustomGatedDeltaNet
    with pytest.raises(UnsupportedModelError, match="unknown Gated DeltaNet variant .*CustomGatedDeltaNet"):
        patch_model(model)


def test_model_without_gated_deltanet_is_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="'qwen3'.*has no Gated DeltaNet layers"):
        patch_model(model)


def test_lora_on_the_conv_is_refused_with_the_fix():
    from peft import LoraConfig, get_peft_model

    base = model_for("qwen3_5")
    rank = base.model.layers[0].linear_attn.conv_dim  # peft needs the rank divisible by the conv's groups
    model = get_peft_model(base, LoraConfig(r=rank, target_modules=["conv1d", "out_proj"]))
    with pytest.raises(ValueError, match="Remove `conv1d` from lora_target_modules"):
        patch_model(model)


def test_require_mode_on_cpu_names_every_op_that_would_fall_back():
    model = model_for("qwen3_5")
    with pytest.raises(KernelUnavailableError) as err:
        patch_model(model, backend="require")
    for op in ("gated_delta_rule", "causal_conv", "gated_rmsnorm", "varlen_attention"):
        assert op in str(err.value)
    assert "fastqwen_kernels: auto" in str(err.value)


def test_unpatch_restores_every_global_the_patch_touched(monkeypatch):
    """Module globals and class attributes of every module the patch reaches (the modeling module,
    peft's LoRA layers, fla's Hopper-guard module) are identical before the patch and after
    unpatch_model, with a training step in between; fla's guard included, as the GPU self-check
    lifts it (simulated here: on this CPU the guard's Triton test cannot be true, so fla's global is
    set to what Triton 3.6 gives before the snapshot)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import layer as lora_layer

    from axolotl_fastqwen.kernel_choice import hopper_guard

    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, target_modules=LORA_TARGETS))
    modeling = __import__(type(model.get_base_model()).__module__, fromlist=["_"])

    def snapshot():
        out = {}
        for module in (modeling, lora_layer, chunk_o):
            out[module.__name__] = dict(vars(module))
            for obj in vars(module).values():
                if isinstance(obj, type) and obj.__module__ == module.__name__:
                    out[f"{module.__name__}.{obj.__name__}"] = dict(vars(obj))
        instance = {name: {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")}
                    for name, m in model.named_modules()}
        return out, instance

    def same(a, b):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for key in a:
            changed = [k for k in set(a[key]) | set(b[key]) if a[key].get(k, KeyError) is not b[key].get(k, KeyError)]
            assert not changed, (key, changed)

    before = snapshot()
    report = patch_model(model)
    model(**packed_batch(sequences(model.config.vocab_size))).loss.backward()
    hopper_guard.lift(report.kernels)  # what the self-check does when fla's GDN passes with the guard lifted
    assert chunk_o.TRITON_ABOVE_3_7_1 is True
    unpatch_model(model)
    after = snapshot()
    same(before[0], after[0])
    same(before[1], after[1])
    assert chunk_o.TRITON_ABOVE_3_7_1 is False and not hopper_guard.lifted_by(report.kernels)


def test_selfcheck_dtype_is_what_the_kernels_receive_under_qlora_style_dtypes():
    """QLoRA leaves the conv weights in fp32 (peft's `prepare_model_for_kbit_training` upcasts every
    bf16 parameter) while Axolotl converts norms and embeddings back to bf16 and the Trainer runs
    under bf16 autocast. The self-check must test the dtype the kernels really receive (measured
    here on the projection in front of them), not the conv weight's: on the H200 the fp32 check
    autotuned a second kernel set for minutes and rejected fla for a bf16 run. Break
    `kernel_input_dtype` back to `conv1d.weight.dtype` and this fails."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from axolotl_fastqwen.patching.decoder_hook import check_shapes, kernel_input_dtype
    from axolotl_fastqwen.families.base import unwrap

    model = model_for("qwen3_5").to(torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for name, module in model.named_modules():  # Axolotl's _convert_embedding_modules_dtype, bf16 run
        if "norm" in name or "embed_tokens" in name or "lm_head" in name:
            module.to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj_qkv", "q_proj"]))
    patch_model(model)
    base = unwrap(model)
    gdn = next(m for m in base.modules() if hasattr(m, "A_log"))
    assert gdn.conv1d.weight.dtype == torch.float32  # the trap: the layer's own weights say fp32
    ids = torch.randint(0, model.config.vocab_size, (1, 24))

    def predicted_and_seen(model, autocast):
        base = unwrap(model)
        gdn = next(m for m in base.modules() if hasattr(m, "A_log"))
        seen = []
        handle = gdn.in_proj_qkv.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                predicted = kernel_input_dtype(base, torch.device("cpu"))
                model(input_ids=ids, labels=ids)
        finally:
            handle.remove()
        assert check_shapes(base).dtype == seen[0]  # the default the benchmark's self-check uses
        return predicted, seen[0]

    assert predicted_and_seen(model, autocast=True) == (torch.bfloat16, torch.bfloat16)
    # without autocast (such mixed dtypes would not run there): the residual stream's dtype
    plain = model_for("qwen3_5").to(torch.bfloat16)
    patch_model(plain)
    assert predicted_and_seen(plain, autocast=False) == (torch.bfloat16, torch.bfloat16)
