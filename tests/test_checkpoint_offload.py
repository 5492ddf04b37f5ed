"""`patch_model(checkpoint_offload=True)` (`fastqwen_checkpoint_offload`): recomputed layers' inputs
in host memory.

On a CPU the inputs are already in host memory, so these tests let the offload take CPU tensors
(`devices=("cpu",)`, no size floor): every saved input is copied into a host buffer and the graph
holds only a handle, which is the path a GPU runs, less the streams (the GPU test
`test_checkpoint_offload_on_the_27b_slice` runs those).

References: stock transformers on each sequence alone (fp32, `test_checkpointing`'s 1e-4 for 8
layers), and the same patched model without the offload, bit for bit: the offload copies values
and the recompute is the same computation, so any difference is a restored input that is not the
layer's own.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.memory.checkpoint_fitter import decoder_layers
from test_checkpointing import GLOBAL_TOL, eight_layer_lora_model
from test_patching import TENSOR_TOL, alone_loss_and_grads, grads, packed_batch, rel, sequences

LAYERS = 8


def offloaded(model, **kw):
    """Patch with the offload on, taking CPU tensors as a GPU run takes CUDA ones."""
    report = patch_model(model, checkpoint_offload=True, log=False)
    report.offload.devices, report.offload.min_bytes = ("cpu",), 1
    for key, value in kw.items():
        setattr(report.offload, key, value)
    return report


def keep_last(model, kept):
    layers, _ = decoder_layers(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < len(layers) - kept


def step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, num_items_in_batch=torch.tensor(1))
    out.loss.backward()
    return out.loss.detach(), grads(model)


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kept", [0, 3])
def test_offloaded_inputs_train_as_each_sequence_alone_and_change_no_bit(reentrant, kept):
    model = eight_layer_lora_model(gc=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    seqs = sequences(model.config.vocab_size)
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, "qwen3_5")
    batch = packed_batch(seqs)
    patch_model(model, log=False)
    keep_last(model, kept)
    plain = step(model, batch)
    unpatch_model(model)

    report = offloaded(model)
    keep_last(model, kept)
    loss, ours = step(model, batch)
    stats = report.offload.stats
    recomputed = LAYERS - kept
    assert (stats.offloaded, stats.restored, stats.prefetched) == (recomputed, recomputed, recomputed - 1)
    tokens, hidden = batch["input_ids"].numel(), model.config.hidden_size
    assert stats.offloaded_bytes == recomputed * tokens * hidden * 4  # kept layers move nothing
    assert f"checkpoint offload: {recomputed} recomputed layers' inputs in pinned host memory" in report.format()
    assert_same((loss, ours), plain)
    assert abs(float(loss) - alone_loss) <= GLOBAL_TOL * alone_loss
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    assert rel(flat(ours), flat(alone_grads)) <= GLOBAL_TOL
    assert all(rel(ours[k], alone_grads[k]) <= TENSOR_TOL for k in alone_grads)
    unpatch_model(model)


def test_two_forwards_before_one_backward_keep_their_own_inputs():
    """A buffer is free again only when autograd drops its input: a second forward before the
    first one's backward takes other buffers (reusing the first forward's would restore the
    second row's inputs into the first row's recompute)."""
    model = eight_layer_lora_model()
    vocab = model.config.vocab_size
    first, second = packed_batch(sequences(vocab, seed=1)), packed_batch(sequences(vocab, seed=2))

    def both():
        model.zero_grad(set_to_none=True)
        loss = model(**first).loss + model(**second).loss
        loss.backward()
        return loss.detach(), grads(model)

    patch_model(model, log=False)
    plain = both()
    unpatch_model(model)
    report = offloaded(model)
    assert_same(both(), plain)
    assert report.offload.stats.host_bytes == 2 * LAYERS * first["input_ids"].numel() * model.config.hidden_size * 4
    assert_same(both(), plain)  # the next step reuses the buffers the first one released
    assert report.offload.stats.host_bytes == 2 * LAYERS * first["input_ids"].numel() * model.config.hidden_size * 4
    unpatch_model(model)


def test_past_the_host_limit_inputs_stay_on_the_device():
    model = eight_layer_lora_model()
    batch = packed_batch(sequences(model.config.vocab_size))
    patch_model(model, log=False)
    plain = step(model, batch)
    unpatch_model(model)
    one_input = batch["input_ids"].numel() * model.config.hidden_size * 4
    report = offloaded(model, host_limit=3 * one_input)
    assert_same(step(model, batch), plain)
    stats = report.offload.stats
    assert (stats.offloaded, stats.kept_on_device, stats.host_bytes) == (3, LAYERS - 3, 3 * one_input)
    unpatch_model(model)


def test_a_checkpoint_function_set_after_patching_is_wrapped_and_unpatch_gives_it_back():
    """Trainers call `gradient_checkpointing_enable` after the model is patched: the next forward
    wraps what it set, and unpatching leaves each layer the function the trainer gave it."""
    model = eight_layer_lora_model(gc=False)
    report = offloaded(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers, _ = decoder_layers(model)
    given = [layer._gradient_checkpointing_func for layer in layers]
    model(**packed_batch(sequences(model.config.vocab_size))).loss.backward()
    assert report.offload.stats.offloaded == LAYERS
    assert all(layer._gradient_checkpointing_func.original is f for layer, f in zip(layers, given))
    with torch.no_grad():  # evaluation: no checkpoint saves, nothing moves
        model.eval()
        model(**packed_batch(sequences(model.config.vocab_size)))
    assert report.offload.stats.offloaded == LAYERS
    unpatch_model(model)
    assert all(layer._gradient_checkpointing_func is f for layer, f in zip(layers, given))


def auto_offload(model, device_bytes, allocated=0):
    """Patch with `checkpoint_offload="auto"`, deciding as if the CPU were a device of `device_bytes`
    with `allocated` in use (a CPU has no device memory: there `auto` stays off)."""
    report = patch_model(model, checkpoint_offload="auto", log=False)
    report.offload.devices, report.offload.min_bytes = ("cpu",), 1
    report.offload.device_memory = lambda device: (allocated, device_bytes)
    return report


@pytest.mark.parametrize("kept", [0, 3])
def test_auto_moves_nothing_where_the_inputs_fit_and_everything_where_they_crowd_the_device(kept):
    """`auto` sums the inputs the recomputed layers will keep (layers x tokens x hidden x the
    residual's bytes) with what is allocated, against 75% of the device: just under, nothing
    moves; just over, it turns on at that very forward, for good, with the run's bits."""
    model = eight_layer_lora_model()
    batch = packed_batch(sequences(model.config.vocab_size))
    patch_model(model, log=False)
    keep_last(model, kept)
    plain = step(model, batch)
    unpatch_model(model)
    recomputed = LAYERS - kept
    inputs = recomputed * batch["input_ids"].numel() * model.config.hidden_size * 4  # fp32 toy
    allocated = 1000

    report = auto_offload(model, device_bytes=int((allocated + inputs) / 0.75) + 8, allocated=allocated)
    keep_last(model, kept)
    assert_same(step(model, batch), plain)
    assert report.offload.stats.offloaded == 0 and not report.offload.active
    assert report.offload.why.startswith(f"off: {recomputed} recomputed layers' inputs")
    assert "checkpoint offload: auto, off:" in report.format()
    unpatch_model(model)

    report = auto_offload(model, device_bytes=int((allocated + inputs) / 0.75) - 8, allocated=allocated)
    keep_last(model, kept)
    assert_same(step(model, batch), plain)
    assert report.offload.active and report.offload.stats.offloaded == recomputed
    # what the last forward moved, still counted after its backward dropped the handles
    assert report.offload.to_dict()["last_forward_bytes"] == inputs
    assert report.offload.why.startswith(f"on: {recomputed} recomputed layers' inputs")
    report.offload.device_memory = lambda device: (0, 1 << 60)  # once on, it stays on
    assert_same(step(model, batch), plain)
    assert report.offload.stats.offloaded == 2 * recomputed
    text = report.format()
    assert "checkpoint offload: auto, on:" in text and f"{recomputed} recomputed layers' inputs in pinned" in text
    unpatch_model(model)


def test_auto_stays_off_on_a_cpu_and_without_recomputed_layers():
    model = eight_layer_lora_model()
    batch = packed_batch(sequences(model.config.vocab_size))
    report = patch_model(model, checkpoint_offload="auto", log=False)
    step(model, batch)  # a CPU: the default memory reader has no device memory to read
    assert not report.offload.active and report.offload.why == "off: nothing to move on cpu"
    report.offload.devices = ("cpu",)
    step(model, batch)
    assert not report.offload.active and report.offload.why == "off: no device memory to spare on cpu"
    report.offload.device_memory = lambda device: (0, 1)
    keep_last(model, LAYERS)
    step(model, batch)
    assert not report.offload.active and report.offload.why == "off: no layer is recomputed"
    unpatch_model(model)
    with pytest.raises(ValueError, match="False, True or 'auto'"):
        patch_model(model, checkpoint_offload="on", log=False)
