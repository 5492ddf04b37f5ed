"""`patch_model(mlp_chunk_tokens=...)` (`fastqwen_mlp_chunk_tokens`): dense MLPs over token chunks.

References: the same LoRA model patched without chunks (the plugin's own path, which the rest of the
suite holds to stock transformers), on the same packed row. The MLP is per token, so chunking changes
only the shapes of its GEMMs: fp32 on CPU, within 1e-6 relative (a GEMM of fewer rows may sum in
another order; measured 0 here, the bound leaves room for BLAS blocking). What autograd holds is
counted with an outer saved-tensor hook: the tensors a checkpointed chunk recomputes are not saved.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from test_lean_activations import keep, lora_model
from test_patching import packed_batch, sequences

LENGTHS = [70, 1, 57, 100]  # 228 tokens in a 256-token row: chunks of 64 cut sequences and leave a remainder
TOL = 1e-6


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class SavedBytes:
    """An outer saved-tensor hook: the bytes of the distinct storages autograd holds for backward."""

    def __init__(self):
        self.storages = {}

    def pack(self, t):
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    @property
    def total(self):
        return sum(self.storages.values())


@pytest.mark.parametrize("gc", [False, True])
def test_chunked_mlps_give_the_loss_and_gradients_of_the_whole_row(gc):
    model = lora_model("qwen3_5", gc=gc)
    if gc:
        keep(model, 1)  # one layer keeps its activations, the others are recomputed: chunks nest in both
    batch = packed_batch(sequences(model.config.vocab_size, LENGTHS))
    patch_model(model, fused_cross_entropy=False, log=False)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    unpatch_model(model)
    report = patch_model(model, fused_cross_entropy=False, mlp_chunk_tokens=64, log=False)
    loss, grads = loss_and_grads(model, batch)
    chunks = report.to_dict()["mlp_chunks"]
    layers = model.config.num_hidden_layers
    assert chunks["mlps"] == layers and chunks["chunk_tokens"] == 64
    assert chunks["chunked_forwards"] == layers + (layers - 1 if gc else 0)  # a recomputed layer runs its MLP twice
    assert "mlp chunks: 4 dense MLPs run rows of more than 64 tokens" in report.format()
    assert rel(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys() and all(rel(grads[n], ref_grads[n]) <= TOL for n in grads)


def test_a_chunked_mlp_holds_none_of_its_intermediates():
    """A layer that keeps its activations: without chunks autograd holds the MLP's gate and up
    outputs and their SwiGLU product (each [tokens, intermediate]); with chunks, none of them."""
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, LENGTHS))
    tokens, wide = batch["input_ids"].numel(), model.config.intermediate_size
    held = {}
    for chunk in (None, 64):
        patch_model(model, fused_cross_entropy=False, mlp_chunk_tokens=chunk, log=False)
        with SavedBytes() as saved:
            loss = model(**batch).loss
        held[chunk] = saved.total
        loss.backward()
        unpatch_model(model)
    layers = model.config.num_hidden_layers
    intermediates = 3 * tokens * wide * 4 * layers  # fp32 on CPU
    assert held[None] - held[64] >= intermediates, (held, intermediates)


def test_rows_within_the_chunk_run_the_mlp_as_before_and_unpatch_restores_it():
    model = lora_model("qwen3_5", gc=False)
    mlp = model.get_base_model().model.layers[0].mlp
    forward = mlp.forward
    report = patch_model(model, fused_cross_entropy=False, mlp_chunk_tokens=256, log=False)
    assert mlp.forward is not forward
    model(**packed_batch(sequences(model.config.vocab_size, LENGTHS))).loss.backward()
    assert report.to_dict()["mlp_chunks"]["chunked_forwards"] == 0  # 256 tokens: one chunk, no checkpoint
    unpatch_model(model)
    assert mlp.forward == forward and "forward" not in mlp.__dict__
    with pytest.raises(ValueError, match="must be positive"):
        patch_model(model, mlp_chunk_tokens=0, log=False)


def test_moe_models_have_no_dense_mlp_to_chunk_and_the_report_says_so():
    model = lora_model("qwen3_5_moe", gc=False)
    report = patch_model(model, fused_cross_entropy=False, mlp_chunk_tokens=64, log=False)
    assert report.mlp_chunks is None
    assert any(n.startswith("mlp chunks: not applied: qwen3_5_moe routes tokens to experts") for n in report.kernels.notes)


def test_chunks_compose_with_fp8_whose_per_token_scales_they_do_not_change(monkeypatch):
    """With `fastqwen_fp8` the MLP's projections quantize their inputs and output gradients per token,
    so a chunk quantizes each token exactly as the whole row does: the run with chunks gives the FP8
    run's loss and gradients (1e-6, as above), through the recompute too."""
    from axolotl_fastqwen.patching import fp8_weights

    monkeypatch.setattr(fp8_weights, "MIN_FEATURES", 64)  # the toy's projections count as large enough
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, LENGTHS))
    results = []
    for chunk in (None, 64):
        report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, mlp_chunk_tokens=chunk,
                             log=False)
        assert report.to_dict()["fp8"]["modules_fp8"] > 0
        results.append(loss_and_grads(model, batch))
        unpatch_model(model)
    (l0, g0), (l1, g1) = results
    assert rel(l1, l0) <= TOL and all(rel(g1[n], g0[n]) <= TOL for n in g0)
