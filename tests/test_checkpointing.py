"""`fastqwen_checkpointing: auto` (memory/checkpoint_fitter.py) on CPU.

Exactness: whichever layers the fitter keeps, training gives the gradients of stock transformers
on each sequence alone (fp32; 1e-4 global and per tensor: the patching tests' 1e-5 is for 4
layers, and this model has 8, so the round-off chain is twice as long: measured 0.6e-5 to 4.4e-5
over random LoRA initialisations; a leak across sequences or a recompute with other boundaries is
O(1e-1)).
Sizing: the fitter's decisions are arithmetic on peak-memory readings; a CPU has no such
counters, so these tests read a memory model that charges a fixed amount per layer whose
`gradient_checkpointing` flag is off, i.e. it reads the very flags the fitter sets. The real CUDA
counters are exercised by `test_gpu_kernels.py::test_checkpoint_fitter_on_the_gpu`.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.memory.checkpoint_fitter import (
    FIT_STEPS, GIB, KEPT_LAYER_INPUTS, CheckpointFitter, decoder_layers,
)
from test_patching import (  # noqa: E402  (shared helpers of the patching tests)
    LORA_TARGETS, TENSOR_TOL, alone_loss_and_grads, grads, model_for, packed_batch, rel, sequences,
)

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
GLOBAL_TOL = 1e-4


def eight_layer_lora_model(gc=True):
    from peft import LoraConfig, get_peft_model

    model = model_for("qwen3_5", num_hidden_layers=8, layer_types=LAYER_TYPES * 2)
    torch.manual_seed(0)  # peft draws the random adapter init from the global generator
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class LayerMemory:
    """A memory model that reads the model's own execution: each decoder layer's forward leaves
    `output` bytes allocated, plus `per_layer` more when its checkpointing flag is off (held until
    the step ends). A step's peak is the larger of `base` (another phase of the step: loss,
    optimizer) and what the layers hold on top of `base - slack`; `surprise` more after
    `surprise_after` steps (a step that allocates more than the probe predicted)."""

    def __init__(self, layers, *, base, per_layer, total, slack=0, output=GIB // 20, surprise=0,
                 surprise_after=None, retries_above=None):
        self.base, self.per_layer, self.slack, self.output, self._total = base, per_layer, slack, output, total
        self.retries_above, self.retried, self.retried_steps = retries_above, 0, set()
        self.surprise, self.surprise_after, self.steps = surprise, surprise_after, 0
        self.held, self.seen, self.peaks = 0, set(), []
        for layer in layers:
            layer.register_forward_hook(self._forward)

    def _forward(self, layer, args, output):
        if id(layer) not in self.seen:  # its forward, not the recompute in backward
            self.seen.add(id(layer))
            self.held += self.output + (0 if layer.gradient_checkpointing else self.per_layer)

    def total(self):
        return self._total

    def allocated(self):
        return self.base - self.slack + self.held

    def reset_peak(self):
        self.steps += 1
        self.held, self.seen = 0, set()

    def peak(self):
        extra = self.surprise if self.surprise_after is not None and self.steps > self.surprise_after else 0
        self.peaks.append(max(self.base, self.allocated()) + extra)
        return self.peaks[-1]

    def retries(self):
        """Cumulative allocator retries: a step whose layers hold more than `retries_above` retries
        one allocation (fragmentation near the limit)."""
        if self.retries_above is not None and self.allocated() > self.retries_above \
                and self.steps not in self.retried_steps:
            self.retried_steps.add(self.steps)
            self.retried += 1
        return self.retried


@pytest.fixture
def model_and_batch():
    model = eight_layer_lora_model()
    patch_model(model)
    yield model, packed_batch(sequences(model.config.vocab_size))
    unpatch_model(model)


def run_steps(fitter, n, model, batch):
    for _ in range(n):
        fitter.step_begin()
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        fitter.step_end()


def flags(layers):
    return [layer.gradient_checkpointing for layer in layers]


@pytest.mark.parametrize("kept", [0, 4, 8])
def test_any_split_of_kept_and_recomputed_layers_trains_exactly(kept):
    model = eight_layer_lora_model()
    seqs = sequences(model.config.vocab_size)
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, "qwen3_5")
    patch_model(model)
    layers, _ = decoder_layers(model)
    for layer in layers[len(layers) - kept:]:
        layer.gradient_checkpointing = False
    assert sum(not f for f in flags(layers)) == kept
    model.zero_grad(set_to_none=True)
    out = model(**packed_batch(seqs), num_items_in_batch=torch.tensor(1))
    out.loss.backward()
    ours = grads(model)
    unpatch_model(model)
    assert abs(float(out.loss) - alone_loss) <= GLOBAL_TOL * alone_loss
    assert ours.keys() == alone_grads.keys()
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    assert rel(flat(ours), flat(alone_grads)) <= GLOBAL_TOL
    worst = max(alone_grads, key=lambda k: rel(ours[k], alone_grads[k]))
    assert rel(ours[worst], alone_grads[worst]) <= TENSOR_TOL, worst


def test_fitter_keeps_as_many_periods_as_fit_then_holds(model_and_batch):
    model, batch = model_and_batch
    layers, period = decoder_layers(model)
    assert (len(layers), period) == (8, 4)
    # 100 GiB card, limit 85 GiB; base 60, 6 GiB a layer: one period (24) fits, two (48) do not
    memory = LayerMemory(layers, base=60 * GIB, per_layer=6 * GIB, total=100 * GIB)
    fitter = CheckpointFitter(model, memory, fraction=0.85)
    run_steps(fitter, 2, model, batch)  # settling: every layer still recomputed, then the probe period is kept
    assert fitter.phase == "probing" and flags(layers) == [True] * 4 + [False] * 4
    run_steps(fitter, 1, model, batch)
    assert fitter.period_bytes == 24 * GIB and fitter.kept == 4 and fitter.phase == "fitted"
    run_steps(fitter, 3, model, batch)
    assert fitter.phase == "settled" and fitter.kept == 4
    assert flags(layers) == [True] * 4 + [False] * 4  # the last layers are the ones kept
    d = fitter.to_dict()
    assert d["kept_layers"] == 4 and d["recomputed_layers"] == 4 and d["base_peak_gib"] == 60.4
    fitter.restore()
    assert flags(layers) == [True] * 8


def test_no_probe_where_one_kept_period_may_not_fit(model_and_batch):
    """Long rows: with every layer recomputed the peak already sits near the limit, and keeping the
    probe's 4 layers (each bounded by KEPT_LAYER_INPUTS times its input) could run out of memory
    before the fit gives them back (H100, 32k tokens): nothing is probed, with the numbers. With
    room for that bound, the probe runs."""
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    one_input = batch["input_ids"].numel() * model.config.hidden_size * 4  # fp32 on CPU
    bound = 4 * KEPT_LAYER_INPUTS * one_input
    base_peak = 60 * GIB + 8 * (GIB // 20)  # LayerMemory: base + each recomputed layer's output
    for room, probed in ((bound // 2, False), (2 * bound, True)):
        memory = LayerMemory(layers, base=60 * GIB, per_layer=6 * GIB, total=int((base_peak + room) / 0.85) + 1)
        fitter = CheckpointFitter(model, memory, fraction=0.85)
        run_steps(fitter, 2, model, batch)
        assert fitter.input_bytes == one_input
        assert (fitter.phase == "probing") is probed, fitter.to_dict()
        if not probed:
            assert fitter.kept == 0 and flags(layers) == [True] * 8
            assert "may take up to" in fitter.summary() and "not probed" in fitter.summary()
        fitter.restore()


def test_fitter_sizes_from_what_layers_hold_not_from_the_peak_slope(model_and_batch):
    """The base peak comes from another phase, 10 GiB above what the layers sit on: the probe's 4
    kept layers (5 GiB each) raise the peak by only 10 GiB. Extrapolating that slope would keep 8
    layers and reach 90 GiB, over the 85 GiB limit (what ran out of memory on the H200); the
    growth after each layer's forward says 20 GiB a period: 4 layers kept, peak 70 GiB."""
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    memory = LayerMemory(layers, base=60 * GIB, per_layer=5 * GIB, slack=10 * GIB, total=100 * GIB)
    fitter = CheckpointFitter(model, memory, fraction=0.85)
    run_steps(fitter, 6, model, batch)
    assert fitter.kept == 4 and fitter.phase == "settled", fitter.to_dict()
    assert max(memory.peaks) <= fitter.limit
    assert fitter.to_dict()["probe_gib_held_per_layer"]["kept"] == [5.05] * 4


def test_fitter_keeps_more_when_the_fitted_step_leaves_room_for_a_period(model_and_batch):
    """The base peak (60 GiB) comes from another phase, 10 GiB above what the layers sit on, so the
    bound `base + periods x 16 GiB` keeps one period (76 <= 85, 92 > 85); the fitted step then
    peaks at 66.4 GiB, 18.6 under the limit: one more period fits, and 8 kept peak at 82.4."""
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    memory = LayerMemory(layers, base=60 * GIB, per_layer=4 * GIB, slack=10 * GIB, total=100 * GIB)
    fitter = CheckpointFitter(model, memory, fraction=0.85)
    run_steps(fitter, 3, model, batch)
    assert fitter.kept == 4 and fitter.phase == "fitted"
    run_steps(fitter, 1, model, batch)
    assert fitter.kept == 8 and fitter.phase == "fitted" and "room for 1 period" in fitter.decisions[-1].why
    run_steps(fitter, 1, model, batch)
    assert fitter.phase == "settled" and fitter.kept == 8 and max(memory.peaks) <= fitter.limit
    assert fitter.step == FIT_STEPS  # settled within the steps the bench gives a fitting path


def test_fitter_keeps_every_layer_when_all_fit(model_and_batch):
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    fitter = CheckpointFitter(model, LayerMemory(layers, base=10 * GIB, per_layer=GIB, total=100 * GIB))
    run_steps(fitter, 5, model, batch)
    assert fitter.phase == "settled" and fitter.kept == 8 and not any(flags(layers))
    assert fitter.recomputed_fraction() == 0.0


def test_fitter_gives_a_period_back_when_a_step_goes_over_the_limit(model_and_batch):
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    memory = LayerMemory(layers, base=10 * GIB, per_layer=GIB, total=100 * GIB, surprise=70 * GIB, surprise_after=5)
    fitter = CheckpointFitter(model, memory, fraction=0.85)
    run_steps(fitter, 5, model, batch)
    assert fitter.kept == 8
    run_steps(fitter, 1, model, batch)  # the step's peak is 10 + 8 + 0.4 + 70 = 88.4 GiB > 85: one period back
    assert fitter.kept == 4 and flags(layers) == [True] * 4 + [False] * 4
    run_steps(fitter, 1, model, batch)  # 10 + 4 + 0.4 + 70 = 84.4 GiB: within the limit
    assert fitter.phase == "settled" and fitter.kept == 4
    assert "one period back" in fitter.decisions[-2].why


def test_fitter_gives_a_period_back_when_settled_steps_stall_the_allocator(model_and_batch):
    """All 8 layers fit by the peak, but a step holding more than 15 GiB makes the allocator flush
    and retry (as seen on the H200 at 114 GiB without expandable segments: ~0.13 s of idle GPU a
    step). The first step after a change may re-lay the cache, so it is tolerated; a settled step
    that retries gives a period back, and 4 kept layers (14.4 GiB) run without retries."""
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    memory = LayerMemory(layers, base=10 * GIB, per_layer=GIB, total=100 * GIB, retries_above=15 * GIB)
    fitter = CheckpointFitter(model, memory)
    run_steps(fitter, 4, model, batch)  # settling x2, probe, the fitted step (8 kept: retried, tolerated)
    assert fitter.kept == 8 and fitter.phase == "settled" and memory.retried == 1
    run_steps(fitter, 1, model, batch)  # settled and retried: one period back
    assert fitter.kept == 4 and fitter.retries_seen == 1 and "retried 1 allocation" in fitter.decisions[-1].why
    run_steps(fitter, 3, model, batch)  # 60 GiB of room, but 8 stalled: it does not grow back
    assert fitter.phase == "settled" and fitter.kept == 4 and memory.retried == 2
    assert fitter.to_dict()["allocator_retries_in_settled_steps"] == 1


def test_fitter_recomputes_everything_when_even_the_baseline_is_over_the_limit(model_and_batch):
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    fitter = CheckpointFitter(model, LayerMemory(layers, base=90 * GIB, per_layer=GIB, total=100 * GIB))
    run_steps(fitter, 4, model, batch)
    assert fitter.phase == "off" and fitter.kept == 0 and all(flags(layers))
    assert "already over the limit" in fitter.summary()


def test_fitter_undoes_a_probe_that_does_not_fit(model_and_batch):
    model, batch = model_and_batch
    layers, _ = decoder_layers(model)
    fitter = CheckpointFitter(model, LayerMemory(layers, base=80 * GIB, per_layer=2 * GIB, total=100 * GIB),
                              fraction=0.85)
    run_steps(fitter, 3, model, batch)  # probe: 80 + 8 + 0.4 = 88.4 GiB > 85
    assert fitter.phase == "off" and all(flags(layers))


def test_fitter_does_nothing_without_gradient_checkpointing_or_without_counters(model_and_batch):
    model = eight_layer_lora_model(gc=False)
    layers, _ = decoder_layers(model)
    fitter = CheckpointFitter(model, LayerMemory(layers, base=GIB, per_layer=GIB, total=100 * GIB))
    run_steps(fitter, 5, *model_and_batch)
    assert fitter.phase == "off" and "not on" in fitter.off_reason and not any(flags(layers))
    model, batch = model_and_batch
    fitter = CheckpointFitter(model, None)  # a CPU: no peak-memory counters
    run_steps(fitter, 5, model, batch)
    assert fitter.phase == "off" and "no CUDA device" in fitter.off_reason and all(flags(decoder_layers(model)[0]))
