"""`fastqwen_lean_activations` (memory/lean_activations.py) on CPU: what is dropped, and that nothing changes.

Exactness: a dropped output is recomputed by the same function on the same inputs, so training
with lean activations must give the gradients of training without them bit for bit
(`torch.equal`, no tolerance): any other recipe, input or layout would show.
Memory: autograd's saved tensors are read through an outer saved-tensor hook (lean activations
hand it every tensor they do not drop, as they would Axolotl's activation offloading): a dropped
output's storage must not be among them, and without lean activations it is.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.memory.lean_activations import INPUT_NOT_SAVED, LeanActivationsError
from saved_tensors import SavedTensors
from test_patching import (  # noqa: E402  (shared helpers of the patching tests)
    FAMILIES, LORA_TARGETS, TOL, alone_loss_and_grads, assert_grads_close, grads, model_for, packed_batch, sequences,
)


def lora_model(family, gc=True):
    from peft import LoraConfig, get_peft_model

    model = model_for(family)
    torch.manual_seed(0)  # the adapters' random init (init_lora_weights=False): a fixed draw
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def layers_of(model):
    return list(model.get_base_model().model.layers)


def keep(model, n):
    """The last `n` layers keep their activations, as `fastqwen_checkpointing: auto` leaves them."""
    layers = layers_of(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < len(layers) - n


def norm_outputs(model):
    """Record the storage of each decoder layer's norm outputs, of the gated norm's output (out_proj's
    input), of the attention's gated output (o_proj's input) and of the MLP's SwiGLU product (down_proj's
    input); the tensors are kept alive until the hooks are removed."""
    seen: dict[str, int] = {}
    alive = []  # held by the test, so that no later tensor reuses their memory and aliases their address
    handles = []

    def record(key, tensor):  # returns None: a hook's return value would replace the output
        alive.append(tensor)
        seen.setdefault(key, tensor.untyped_storage().data_ptr())

    for i, layer in enumerate(layers_of(model)):
        for name in ("input_layernorm", "post_attention_layernorm"):
            handles.append(getattr(layer, name).register_forward_hook(
                lambda m, a, out, key=f"{i}.{name}": record(key, out)))
        if hasattr(layer, "linear_attn"):
            handles.append(layer.linear_attn.out_proj.register_forward_pre_hook(
                lambda m, a, key=f"{i}.gated_norm": record(key, a[0])))
        else:
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, key=f"{i}.gated_output": record(key, a[0])))
        mlp = getattr(layer.mlp, "shared_expert", layer.mlp)  # MoE: the shared expert is the dense MLP
        handles.append(mlp.down_proj.register_forward_pre_hook(
            lambda m, a, key=f"{i}.mlp_product": record(key, a[0])))
    return seen, handles


def step(model, batch, lean, *, keep_last=None):
    report = patch_model(model, lean_activations=lean, log=False)
    if keep_last is not None:
        keep(model, keep_last)
    seen, handles = norm_outputs(model)
    model.zero_grad(set_to_none=True)
    with SavedTensors() as saved:
        loss = model(**batch, num_items_in_batch=torch.tensor(1)).loss
    held = {key for key, ptr in seen.items() if ptr in saved.storages}
    loss.backward()
    for h in handles:
        h.remove()  # and the recorded tensors go with the hooks' closures
    lean_dict = report.to_dict()["lean_activations"]
    unpatch_model(model)
    return loss.detach(), grads(model), held, lean_dict


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_activations_change_no_bit_and_hold_no_norm_output(family):
    """Two of four layers kept (one Gated DeltaNet, the attention layer), two recomputed; the
    independent reference is stock transformers on each sequence alone (test_patching's tolerance)."""
    model = lora_model(family)
    seqs = sequences(model.config.vocab_size)
    batch = packed_batch(seqs)
    alone_loss, alone = alone_loss_and_grads(model, seqs, family)
    loss, ref, held_before, off = step(model, batch, lean=False, keep_last=2)
    lean_loss, ours, held_after, report = step(model, batch, lean=True, keep_last=2)

    assert abs(float(lean_loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(ours, alone)
    assert off is None
    assert torch.equal(lean_loss, loss)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref), \
        [k for k in ref if not torch.equal(ours[k], ref[k])]
    kept_layers = {"2.input_layernorm", "2.post_attention_layernorm", "2.gated_norm", "2.mlp_product",  # GDN
                   "3.input_layernorm", "3.post_attention_layernorm", "3.gated_output", "3.mlp_product"}  # attention
    held = kept_layers & held_before  # without lean, autograd holds those a LoRA A reads (LORA_TARGETS
    # misses Qwen3-Next's in_proj_qkvz, and peft moves its gate/up/down LoRA to the routed experts: it holds fewer)
    assert {"2.gated_norm", "3.input_layernorm", "3.gated_output"} <= held and (family == "qwen3_next" or held == kept_layers), held
    assert not held_after & kept_layers, held_after & kept_layers
    assert report["lean_layers_last_forward"] == 2 and report["outputs_dropped_per_forward"] == len(held), report
    assert report["saves_kept"] == {}


def test_every_layer_is_lean_without_checkpointing_and_none_under_full_checkpointing():
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size))
    loss, ref, _, _ = step(model, batch, lean=False)
    lean_loss, ours, held, report = step(model, batch, lean=True)
    assert torch.equal(lean_loss, loss) and all(torch.equal(ours[k], ref[k]) for k in ref)
    # layer 0's first norm reads the frozen embeddings' output, which needs no grad, so its own op
    # saves nothing: that output is held as before (saved by two LoRA A's), the other 11 are dropped,
    # and each layer's MLP product
    assert report["lean_layers_last_forward"] == 4 and report["outputs_dropped_per_forward"] == 3 * 3 + 3 - 1 + 4
    assert report["saves_kept"] == {INPUT_NOT_SAVED: 2}
    assert held == {"0.input_layernorm"}

    full = lora_model("qwen3_5", gc=True)
    *_, report = step(full, batch, lean=True)
    assert report["lean_layers_last_forward"] == 0 and report["outputs_dropped_per_forward"] == 0


def test_an_output_whose_inputs_were_not_saved_is_held_as_before():
    """A bf16 model: transformers' RMSNorm and the reference gated norm save fp32 copies of their
    inputs, not the inputs, so dropping an output would only trade it for its input: kept, and said.
    The attention's gated output goes, and each MLP's SwiGLU product: their ops save their bf16 operands
    themselves."""
    model = lora_model("qwen3_5", gc=False).to(torch.bfloat16)
    batch = packed_batch(sequences(model.config.vocab_size))
    loss, ref, held_before, _ = step(model, batch, lean=False)
    lean_loss, ours, held, report = step(model, batch, lean=True)
    assert torch.equal(lean_loss, loss) and all(torch.equal(ours[k], ref[k]) for k in ref)
    products = {f"{i}.mlp_product" for i in range(4)}
    assert report["outputs_dropped_per_forward"] == 1 + 4 and held == held_before - {"3.gated_output"} - products, held
    assert report["saves_kept"].get(INPUT_NOT_SAVED, 0) >= 11, report


def test_an_input_changed_in_place_before_backward_is_refused():
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size))
    patch_model(model, lean_activations=True, log=False)
    loss = model(**batch).loss
    with torch.no_grad():
        layers_of(model)[3].post_attention_layernorm.weight.add_(1.0)
    with pytest.raises(LeanActivationsError, match="modified in place"):  # the norm's weight: not an argument
        loss.backward()


def test_double_backward_through_a_dropped_output_is_refused():
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size))
    patch_model(model, lean_activations=True, log=False)
    loss = model(**batch).loss
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(LeanActivationsError, match="create_graph"):
        torch.autograd.grad(loss, params, create_graph=True)


def test_unpatch_takes_every_hook_off():
    model = lora_model("qwen3_5", gc=False)
    layers = layers_of(model)
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for layer in layers  # noqa: E731
                        for m in (layer, layer.input_layernorm, layer.post_attention_layernorm))
    before = hooks()
    patch_model(model, lean_activations=True, log=False)
    assert hooks() == before + 4 * 4  # per layer: its pre/post hooks, one per norm
    unpatch_model(model)
    assert hooks() == before


def test_axolotl_fused_lora_projections_drop_the_same_outputs_and_change_no_bit():
    """Path l's composition on CPU: Axolotl's own lora_qkv / lora_o kernels attached (its fused
    Gated DeltaNet in-projections and out_proj, attention q/k/v and o; its SwiGLU kernel is Triton,
    so the MLP stays peft's): its autograd functions save the same norm and gate outputs, which are
    dropped and recomputed with the same bits, as are the MLP products."""
    pytest.importorskip("axolotl")
    from fastqwen_bench.paths import _attach_axolotl_lora_kernels
    from fastqwen_bench.restore import Undo

    model = lora_model("qwen3_5", gc=False)
    undo = Undo()
    note = _attach_axolotl_lora_kernels(model, torch.device("cpu"), undo)
    try:
        assert "apply_in_proj_fused" in note and "apply_out_proj" in note, note
        batch = packed_batch(sequences(model.config.vocab_size))
        loss, ref, held_before, _ = step(model, batch, lean=False)
        lean_loss, ours, held, report = step(model, batch, lean=True)
    finally:
        undo.restore()
    assert torch.equal(lean_loss, loss) and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert report["outputs_dropped_per_forward"] == 3 * 3 + 3 - 1 + 4, report  # as with peft's layers
    # Axolotl's o / out_proj functions bypass the modules' forward, so the test records only the
    # 8 norm outputs and the 4 MLP products: all held without lean, only layer 0's first norm's with it
    assert len(held_before) == 12 and held == {"0.input_layernorm"}, (held, held_before)
