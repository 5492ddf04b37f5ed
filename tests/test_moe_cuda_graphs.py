"""The kept layers' sparse MoE blocks replayed as CUDA graphs (`patching/moe_cuda_graphs.py`).

A CUDA graph is captured and replayed only on a GPU (`test_gpu_kernels.py::test_moe_cuda_graphs_*`).
Here the same protocol runs with the two graphs stood in by eager calls that keep its contract
(tests/eager_graph.py). What these tests check against the reference (the same
model trained with the option off, bf16 autocast over fp32 adapters as the Trainer runs LoRA) is the
rest: which calls replay and which run eagerly and why, that autograd gets the input's and every
adapter's gradient from the graph (accumulated over micro-batches), the guard against a backward after
another forward, and that `unpatch_model` gives every block its own forward back. Tolerance: the
stand-in runs the same ops in the same order, so the losses and gradients must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from eager_graph import on_cpu

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.patching import lora_weight_copies, moe_cuda_graphs

peft = pytest.importorskip("peft")
pytest.importorskip("transformers.integrations.moe")


def _model(gc: bool = False):
    """Qwen3.5-MoE with LoRA on attention, Gated DeltaNet and the shared expert: the base in bf16, the
    adapters in fp32 (peft's default under the Trainer's `bf16: true`); non-reentrant checkpointing with `gc`."""
    from test_fused_lora import _bf16_model

    return _bf16_model("qwen3_5_moe", gc=False if gc else None)


def _batch(model, seed: int):
    from test_patching import packed_batch, sequences

    return packed_batch(sequences(model.config.vocab_size, [40, 31, 57], seed=seed), budget=128)


def _graphs(model, on: bool):
    report = patch_model(model, fused_cross_entropy=False, moe_cuda_graphs=on, log=False)
    if on:
        on_cpu(report.moe_graphs)
    return report


def _train(model, steps: int, micro_batches: int = 1):
    """`steps` AdamW steps of `micro_batches` forward + backward each under bf16 autocast: (losses, the
    gradients of the last step)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**_batch(model, seed=10 * step + micro)).loss
            loss.backward()
            losses.append(float(loss.detach()))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return losses, grads


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_replayed_blocks_train_as_the_eager_ones(micro_batches):
    """Five AdamW steps: every loss and the last step's gradients (the shared experts' adapters among them,
    accumulated over micro-batches where there are two) are the eager run's bit for bit; the first
    `WARMUP_CALLS` training calls of each block ran eagerly, then each block was captured once and
    replayed from then on; an eval forward runs eagerly and says so."""
    reference = _model()
    _graphs(reference, on=False)
    ref_losses, ref_grads = _train(reference, steps=5, micro_batches=micro_batches)

    model = _model()
    report = _graphs(model, on=True)
    losses, grads = _train(model, steps=5, micro_batches=micro_batches)
    graphs = report.moe_graphs
    blocks = model.config.num_hidden_layers
    calls = 5 * micro_batches
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys() and any("shared_expert" in n for n in grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert graphs.captures == len(graphs.graphs) == blocks
    assert graphs.eager == {"warm-up": moe_cuda_graphs.WARMUP_CALLS * blocks}
    assert graphs.replays == (calls - moe_cuda_graphs.WARMUP_CALLS) * blocks

    with torch.no_grad():
        model(**_batch(model, seed=99))
    assert graphs.eager["no gradients (eval)"] == blocks
    assert f"{blocks} of {blocks} sparse blocks captured" in report.format()


def test_layers_that_gradient_checkpointing_recomputes_run_the_block_eagerly():
    """A recomputed layer's graph would hold the activations checkpointing frees: its block runs eagerly
    (counted), and the run is the eager one's; layers that keep their activations (transformers' per-layer
    flag, which `fastqwen_checkpointing: auto` sets) replay."""
    reference = _model(gc=True)
    _graphs(reference, on=False)
    ref_losses, ref_grads = _train(reference, steps=3)

    model = _model(gc=True)
    report = _graphs(model, on=True)
    losses, grads = _train(model, steps=3)
    graphs = report.moe_graphs
    blocks = model.config.num_hidden_layers
    assert losses == ref_losses and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert graphs.replays == 0 and graphs.eager == {  # each step's forward and its recompute
        "the layer recomputes its activations (gradient checkpointing)": 2 * 3 * blocks}

    layers = model.base_model.model.model.layers
    layers[-1].gradient_checkpointing = False  # as auto keeps the last layer
    _train(model, steps=4)
    assert graphs.captures == 1 and graphs.replays == 4 - moe_cuda_graphs.WARMUP_CALLS
    graph = graphs.graphs[id(layers[-1].mlp)]
    layers[-1].gradient_checkpointing = True  # as auto gives a period back: the graph's memory is freed
    _train(model, steps=1)
    assert graphs.graphs == {} and graph.static_x is None and graphs.replays == 4 - moe_cuda_graphs.WARMUP_CALLS


def test_a_backward_after_another_forward_of_the_block_raises():
    """Two training forwards, then the first one's backward: the graph holds the second one's
    activations, so the backward says so instead of training on them."""
    model = _model()
    _graphs(model, on=True)
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)  # captured and replayed once
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = model(**_batch(model, seed=1)).loss
        model(**_batch(model, seed=2))
    with pytest.raises(RuntimeError, match="ran another training forward after the one being backpropagated"):
        first.backward()


def test_router_logits_recorded_and_hooks_run_the_block_eagerly():
    """transformers records the router's logits (`output_router_logits`, the auxiliary loss) with a forward
    hook that a replay would skip, and so would any other hook on a module of the block: both run eagerly,
    and the auxiliary loss is the eager run's."""
    reference = _model()
    _graphs(reference, on=False)
    model = _model()
    report = _graphs(model, on=True)
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    _train(reference, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    replays = report.moe_graphs.replays
    batch = _batch(model, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = model(**batch, output_router_logits=True)
        theirs = reference(**batch, output_router_logits=True)
    assert torch.equal(ours.aux_loss, theirs.aux_loss) and torch.equal(ours.loss, theirs.loss)
    blocks = model.config.num_hidden_layers
    assert report.moe_graphs.eager["the router's logits are recorded (output_router_logits)"] == blocks
    assert report.moe_graphs.replays == replays

    block = model.base_model.model.model.layers[0].mlp
    seen = []
    handle = block.shared_expert.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    handle.remove()
    assert len(seen) == 1 and report.moe_graphs.eager["forward hooks on shared_expert"] == 1


def test_unpatch_gives_every_block_its_forward_back():
    model = _model()
    blocks = [layer.mlp for layer in model.base_model.model.model.layers]
    before = [dict(b.__dict__) for b in blocks]
    report = _graphs(model, on=True)
    assert len(report.moe_graphs.blocks) == len(blocks)
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    unpatch_model(model)
    assert [set(b.__dict__) for b in blocks] == [set(d) for d in before]
    assert report.moe_graphs.graphs == {}


def test_dense_models_say_there_is_nothing_to_capture():
    from test_patching import model_for

    report = patch_model(model_for("qwen3_5"), fused_cross_entropy=False, moe_cuda_graphs=True, log=False)
    assert report.moe_graphs is None
    assert any("moe cuda graphs: not applied" in note for note in report.kernels.notes)


def test_auto_captures_on_moe_models_that_train_on_a_gpu_and_says_nothing_elsewhere():
    """`moe_cuda_graphs="auto"` (the Axolotl key's default) installs the graphs where `True` does, but only for a
    model that trains on a CUDA device: on a CPU every call would run eagerly, and a dense model has nothing to
    capture, so auto adds nothing to the report there."""
    from test_patching import model_for

    dense = patch_model(model_for("qwen3_5"), fused_cross_entropy=False, moe_cuda_graphs="auto", log=False)
    assert dense.moe_graphs is None and not any("moe cuda graphs" in note for note in dense.kernels.notes)
    model = _model()
    assert patch_model(model, fused_cross_entropy=False, moe_cuda_graphs="auto", log=False).moe_graphs is None
    unpatch_model(model)
    report = patch_model(model, fused_cross_entropy=False, moe_cuda_graphs=True, log=False)
    assert report.moe_graphs is not None and len(report.moe_graphs.blocks) == len(model.base_model.model.model.layers)
    unpatch_model(model)
    with pytest.raises(ValueError, match="moe_cuda_graphs='yes'"):
        patch_model(model, fused_cross_entropy=False, moe_cuda_graphs="yes", log=False)


def test_replayed_blocks_adapters_cast_for_themselves_and_recomputed_ones_use_the_copies():
    """The shared experts' adapters leave the per-forward copies while their layer keeps its activations (the
    copies' backward node would hold their gradient accumulators on the default stream, where a capture on
    another stream cannot wait), and use them again where the layer recomputes them (no graph there)."""
    from axolotl_fastqwen.patching.fused_lora import peft_linear_layers

    model = _model(gc=True)
    layers = model.base_model.model.model.layers
    for layer in layers:  # every layer kept, as auto keeps them where they fit
        layer.gradient_checkpointing = False
    report = _graphs(model, on=True)
    _train(model, steps=1)
    in_blocks = [m for m in peft_linear_layers(model) if any(m is n for layer in layers for n in layer.mlp.modules())]
    adapted = len(peft_linear_layers(model))
    assert in_blocks and report.fused_lora.copies.layers == adapted - len(in_blocks)
    for layer in layers:
        layer.gradient_checkpointing = True
    _train(model, steps=1)
    assert report.fused_lora.copies.layers == adapted
    unpatch_model(model)
    assert not any(lora_weight_copies.CASTS_ITSELF in m.__dict__ for m in model.modules())


def test_per_forward_adapter_copies_are_not_read_while_a_graph_is_captured(monkeypatch):
    """A graph captured with this forward's cast copies would read those addresses at every replay, after
    they were freed: while a capture runs, `get` has no copy to give (the graph casts the adapters)."""
    copies = lora_weight_copies.LoraWeightCopies(needs_autocast=False)
    module = torch.nn.Linear(4, 4)
    a, b = torch.randn(2, 4), torch.randn(4, 2)
    with torch.no_grad():
        cast = lora_weight_copies.cast_scaled([a, b], (1.0, 2.0), torch.bfloat16)
    copies.copies[id(module)] = ("default", cast[0], cast[1], a._version, b._version)
    assert copies.get(module, "default", torch.bfloat16, a, b) is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert copies.get(module, "default", torch.bfloat16, a, b) is None


def test_a_forward_captures_only_its_share_of_memory_and_auto_sees_the_pools(monkeypatch):
    """Each capture grows the graphs' pools (here 10 bytes a block, of a 100-byte device: the allocator's
    snapshot and the device stood in): once a forward's captures have added `ROUND_FRACTION` of the device,
    the blocks after them stay eager (counted) until the next forward, so the blocks are captured one a
    forward and the losses stay the eager run's. What the pools hold beside their allocated tensors is
    added to every peak `fastqwen_checkpointing: auto` reads, and no longer once `unpatch_model` ran."""
    from axolotl_fastqwen.memory import graph_pools
    from axolotl_fastqwen.memory.checkpoint_fitter import CudaMemory

    reference = _model()
    _graphs(reference, on=False)
    ref_losses, _ = _train(reference, steps=6)

    model = _model()
    graphs = _graphs(model, on=True).moe_graphs
    graphs.device_total = lambda device: 100
    graphs.pool_sizes = lambda: (10 * len(graphs.graphs), 1 * len(graphs.graphs))
    blocks = model.config.num_hidden_layers
    assert 10 >= moe_cuda_graphs.ROUND_FRACTION * 100 and blocks > 1
    losses, _ = _train(model, steps=6)
    assert losses == ref_losses
    captured_per_forward = min(blocks, 6 - moe_cuda_graphs.WARMUP_CALLS)
    assert graphs.captures == captured_per_forward
    assert graphs.eager[moe_cuda_graphs.DEFERRED] == sum(blocks - k for k in range(1, captured_per_forward + 1))
    assert graphs.aside == 9 * graphs.captures and graphs.to_dict()["pool_unallocated_bytes"] == graphs.aside

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000)
    others = graph_pools.aside_bytes() - graphs.aside  # models of other tests in this process
    assert graphs.aside > 0 and CudaMemory(torch.device("cuda")).peak() == 1000 + others + graphs.aside
    unpatch_model(model)
    assert CudaMemory(torch.device("cuda")).peak() == 1000 + others


def test_pools_are_shared_within_a_forward_and_never_captured_into_once_their_graphs_are_gone(monkeypatch):
    """The blocks captured in one forward share a forward pool (as `make_graphed_callables` shares one: each
    block's activations stay allocated, so a later block reuses only an earlier one's transient buffers), each
    forward's captures get their own, and all blocks share one backward pool. Once the graphs that used a pool
    are freed (their layers went back to checkpointing), no capture goes into it again: the CUDA allocator
    retires a pool whose graphs are all freed and refuses a capture into it (`use_count > 0` INTERNAL ASSERT,
    H100, the expert-LoRA run of benchmarks/h100/2026-12-07e). Pool handles stood in by a counter; the real
    capture needs a GPU (`test_moe_cuda_graphs_at_the_35b_a3b_shapes_train_as_eager_with_fewer_launches`)."""
    from eager_graph import EagerGraph

    handles = iter(range(1, 1000))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))

    class PooledGraph(EagerGraph):
        def _capture(self, original, device, owner):
            super()._capture(original, device, owner)
            self.pool, self.backward = owner.forward_pool(), owner.backward_pool()

    model = _model(gc=True)
    layers = model.base_model.model.model.layers
    graphs = _graphs(model, on=True).moe_graphs
    graphs.graph_class = PooledGraph
    graphs.pool_sizes = lambda: (0, 0)
    for layer in layers[-2:]:  # as auto keeps the last two layers: both captured in one forward
        layer.gradient_checkpointing = False
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    first = [graphs.graphs[id(layer.mlp)] for layer in layers[-2:]]
    assert first[0].pool == first[1].pool and first[0].backward == first[1].backward

    layers[-2].gradient_checkpointing = True  # one given back: the other still uses both pools
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    assert list(graphs.graphs) == [id(layers[-1].mlp)]
    layers[-2].gradient_checkpointing = False  # captured again, in a later forward: a forward pool of its own
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    second = graphs.graphs[id(layers[-2].mlp)]
    assert second.pool != first[0].pool and second.backward == first[0].backward

    for layer in layers[-2:]:  # both given back: no graph uses the backward pool any more
        layer.gradient_checkpointing = True
    _train(model, steps=1)
    assert graphs.graphs == {}
    layers[-1].gradient_checkpointing = False
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    again = graphs.graphs[id(layers[-1].mlp)]
    assert again.backward != first[0].backward and again.pool not in {first[0].pool, second.pool}

    layers[-2].gradient_checkpointing = False
    _train(model, steps=moe_cuda_graphs.WARMUP_CALLS + 1)
    other = graphs.graphs[id(layers[-2].mlp)]
    assert other.pool != again.pool and other.backward == again.backward  # another forward: its own pool
