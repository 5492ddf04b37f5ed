"""The plugin's routed experts (`layers/grouped_experts.py`, `fastqwen_grouped`) and peft's expert LoRA run
factored through it (`expert_lora.py`), against stock transformers and stock peft.

References: transformers' eager experts loop, and for LoRA on the experts peft's own
`ParamWrapper` forward (the merged `W + s·B·A`) with the eager experts, on the unpatched model
with transformers' PyTorch kernels. fp32 on CPU: same math in another order, so the tolerance is
fp32 round-off over a few layers (measured <= 5e-6 relative; bound 1e-4).
"""

from __future__ import annotations

import copy

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.layers.experts_implementation import experts_implementation, experts_modules
from axolotl_fastqwen.layers.grouped_experts import GROUPED, ExpertLora, grouped_experts_forward, register
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from tiny_assets import build_tiny_model

peft = pytest.importorskip("peft")
moe = pytest.importorskip("transformers.integrations.moe")

MOE = ["qwen3_5_moe", "qwen3_next"]
TOL = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_qkvz", "out_proj",
                "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _routing(tokens: int, experts: int, k: int, seed: int, skip: int | None = None):
    """Distinct top-k experts per token (expert `skip` never chosen) and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if skip is not None:
        scores[:, skip] = -1.0
    index = scores.argsort(dim=-1, descending=True)[:, :k]
    return index, torch.randn(tokens, k, generator=gen).softmax(-1)


@pytest.mark.parametrize("family", MOE)
def test_grouped_experts_match_the_eager_loop_forward_and_backward(family):
    """Incl. an expert that receives no token (an empty group)."""
    module = experts_modules(build_tiny_model(family))[0]
    experts, k = module.num_experts, module.config.num_experts_per_tok
    index, weights = _routing(40, experts, k, seed=1, skip=experts - 1)
    hidden = torch.randn(40, module.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(2))
    runs = []
    for run in ("eager", "grouped"):
        m = copy.deepcopy(module)
        x, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        if run == "eager":
            m.config = copy.copy(m.config)
            m.config._experts_implementation = "eager"
            out = m(x, index, w)
        else:
            out = grouped_experts_forward(m, x, index, w)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        runs.append((out, x.grad, w.grad, m.gate_up_proj.grad, m.down_proj.grad))
    for got, ref in zip(runs[1], runs[0]):
        assert rel(got, ref) <= TOL
    assert runs[1][3][experts - 1].abs().max() == 0  # the empty group got no gradient


def test_factored_lora_equals_the_merged_weight_with_padded_rank():
    """rank 3 (padded to 8 with zeros inside) against the eager loop on W + s·(A·B)ᵀ."""
    module = experts_modules(build_tiny_model("qwen3_5_moe"))[0]
    experts, k = module.num_experts, module.config.num_experts_per_tok
    hidden_size, inner = module.gate_up_proj.shape[-1], module.down_proj.shape[-1]
    gen = torch.Generator().manual_seed(4)
    shapes = {"gate_up_proj": (hidden_size, 2 * inner), "down_proj": (inner, hidden_size)}
    factors = {n: (torch.randn(experts, i, 3, generator=gen), torch.randn(experts, 3, o, generator=gen) * 0.1)
               for n, (i, o) in shapes.items()}
    index, weights = _routing(24, experts, k, seed=5)
    x = torch.randn(24, hidden_size, generator=gen)
    from axolotl_fastqwen.patching.expert_lora import RANK_MULTIPLE
    import torch.nn.functional as F

    padded = {n: ExpertLora(F.pad(a, (0, RANK_MULTIPLE - 3)), F.pad(b, (0, 0, 0, RANK_MULTIPLE - 3)), 0.5)
              for n, (a, b) in factors.items()}
    got = grouped_experts_forward(module, x, index, weights, lora=padded)
    merged = copy.deepcopy(module)
    merged.config = copy.copy(merged.config)
    merged.config._experts_implementation = "eager"
    with torch.no_grad():
        for n, (a, b) in factors.items():
            getattr(merged, n).add_(0.5 * (a @ b).transpose(-2, -1))
    assert rel(got, merged(x, index, weights)) <= TOL


def _lora_model(family: str, rank: int):
    base = build_tiny_model(family).train()
    targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in base.named_modules())]
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=targets, target_parameters=EXPERT_PARAMS,
                             init_lora_weights=False)  # random A and B: the adapter changes the output
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(base, config)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _batch(vocab: int, length: int = 64):
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _adapters(model):
    return model.base_model.model.__dict__["_fastqwen_patch"]["expert_adapters"]


@pytest.mark.parametrize("rank", [8, 3])
@pytest.mark.parametrize("family", MOE)
def test_expert_lora_runs_factored_and_matches_stock_peft(family, rank):
    """Loss, the router's auxiliary loss and every trainable gradient (all LoRA factors, incl. the
    experts') against stock peft + stock transformers with the eager experts."""
    batch = _batch(build_tiny_model(family).config.vocab_size)
    ref_model = _lora_model(family, rank)
    ref_model.base_model.model.set_experts_implementation("eager")
    with stock_torch_kernels(family):
        ref, ref_grads = _step(ref_model, batch)

    model = _lora_model(family, rank)
    report = patch_model(model, log=False)
    try:
        assert {experts_implementation(m) for m in experts_modules(model)} == {GROUPED}
        out, grads = _step(model, batch)
        installed = _adapters(model).installed
        assert installed and all(f.calls == 1 for f in installed)  # every experts module ran factored, once
        expert_grads = [n for n in ref_grads if ".experts." in n and "lora_" in n]
        assert len(expert_grads) == 4 * len(installed)  # A and B of gate_up_proj and down_proj
        assert rel(out.loss, ref.loss) <= TOL and rel(out.aux_loss, ref.aux_loss) <= TOL
        assert set(grads) == set(ref_grads)
        worst = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
        assert worst <= TOL, worst
        model(**batch)  # a second forward: the report now says the expert LoRA ran factored
        assert any("runs factored" in n for n in report.to_dict()["notes"])
    finally:
        unpatch_model(model)
    assert {experts_implementation(m) for m in experts_modules(model)} == {"grouped_mm"}
    assert all("forward" not in f.outer.__dict__ for f in installed)  # peft's forward again


def test_disabled_or_merged_adapters_go_through_peft():
    """What the factored form does not do is peft's: a disabled adapter gives the base model, a
    merged one the merged weights, neither through the factored path."""
    family = "qwen3_5_moe"
    batch = {"input_ids": _batch(build_tiny_model(family).config.vocab_size)["input_ids"]}  # logits, no loss
    with stock_torch_kernels(family), torch.no_grad():
        base_logits = build_tiny_model(family).train()(**batch).logits
    model = _lora_model(family, 8)
    patch_model(model, log=False)
    try:
        with torch.no_grad():
            lora_logits = model(**batch).logits
            calls = sum(f.calls for f in _adapters(model).installed)
            with model.disable_adapter():
                off = model(**batch).logits
            assert sum(f.calls for f in _adapters(model).installed) == calls
            assert rel(off, base_logits) <= TOL and rel(lora_logits, base_logits) > 1e-2
            model.merge_adapter()
            merged = model(**batch).logits
            assert sum(f.calls for f in _adapters(model).installed) == calls
            assert rel(merged, lora_logits) <= TOL
            model.unmerge_adapter()
    finally:
        unpatch_model(model)


def test_a_deep_copy_of_the_patched_model_runs_its_own_weights():
    model = _lora_model("qwen3_5_moe", 8)
    patch_model(model, log=False)
    batch = {"input_ids": _batch(model.config.vocab_size)["input_ids"]}
    try:
        with torch.no_grad():
            model(**batch)
            twin = copy.deepcopy(model)
            for f in _adapters(twin).installed:  # the copies' forwards are bound to the copies
                assert f.outer.forward is f and f.outer in set(twin.modules()) and f.experts in set(twin.modules())
            for name, p in twin.named_parameters():
                if "experts" in name and "lora_B" in name:
                    p.zero_()
            with model.disable_adapter():
                base = model(**batch).logits
            calls = sum(f.calls for f in _adapters(twin).installed)
            twin_logits = twin(**batch).logits
            assert sum(f.calls for f in _adapters(twin).installed) > calls  # the twin's factored path ran
            lora_logits = model(**batch).logits
        # the twin's experts LoRA is off (B = 0), the original's is not: each ran its own weights
        assert rel(twin_logits, lora_logits) > 1e-3 and rel(lora_logits, base) > 1e-2
    finally:
        unpatch_model(model)


def test_user_chosen_experts_and_the_reference_backend_are_left_alone():
    register()
    for chosen in ("eager", "batched_mm"):
        model = build_tiny_model("qwen3_5_moe")
        model.set_experts_implementation(chosen)
        patch_model(model, log=False)
        assert experts_implementation(experts_modules(model)[0]) == chosen
        unpatch_model(model)
        assert experts_implementation(experts_modules(model)[0]) == chosen
    model = build_tiny_model("qwen3_5_moe")
    patch_model(model, backend="reference", log=False)
    assert experts_implementation(experts_modules(model)[0]) == "grouped_mm"
    unpatch_model(model)


def test_modules_the_computation_does_not_cover_run_transformers_grouped_mm():
    """Expert-parallel shards (fewer local experts than the config's, or the 5.20 flag), biases:
    `supports` says no, the forward is transformers' own `grouped_mm`, and factored LoRA refuses."""
    from axolotl_fastqwen.layers.grouped_experts import supports

    module = experts_modules(build_tiny_model("qwen3_5_moe"))[0]
    assert supports(module)
    for change in ("shard", "flag", "bias"):
        m = copy.deepcopy(module)
        if change == "shard":
            m.gate_up_proj = torch.nn.Parameter(m.gate_up_proj.detach()[:2].clone())
            m.down_proj = torch.nn.Parameter(m.down_proj.detach()[:2].clone())
        elif change == "flag":
            m._is_expert_parallel = True
        else:
            m.has_bias = True
        assert not supports(m), change
    m = copy.deepcopy(module)
    m.has_bias = False
    m._is_expert_parallel = True
    index, weights = _routing(8, module.num_experts, 2, seed=7)
    x = torch.randn(8, module.gate_up_proj.shape[-1])
    # transformers' grouped_mm runs it (no sentinel ids here: the same values)
    assert rel(grouped_experts_forward(m, x, index, weights), grouped_experts_forward(module, x, index, weights)) <= TOL
    with pytest.raises(ValueError, match="factored expert LoRA and the shared expert.s term need"):
        grouped_experts_forward(m, x, index, weights, lora={"gate_up_proj": None})


def test_an_integrations_class_level_wrapper_forward_runs_when_the_experts_are_not_ours(monkeypatch):
    """Axolotl's ScatterMoE patches `ParamWrapper.forward` on the class; with its experts chosen,
    the plugin's instance forward must hand over to whatever the class holds at call time."""
    from peft.tuners.lora.layer import ParamWrapper

    model = _lora_model("qwen3_5_moe", 8)
    patch_model(model, log=False)
    batch = {"input_ids": _batch(model.config.vocab_size)["input_ids"]}
    try:
        with torch.no_grad():
            model(**batch)  # installs the instance forwards
            seen = []
            peft_forward = ParamWrapper.forward

            def integration_forward(self, x, *args, **kwargs):
                seen.append(self)
                return peft_forward(self, x, *args, **kwargs)

            monkeypatch.setattr(ParamWrapper, "forward", integration_forward)
            model.base_model.model.set_experts_implementation("eager")  # not ours: hand over
            model(**batch)
            outers = {id(f.outer) for f in _adapters(model).installed}
            assert outers <= {id(m) for m in seen} and sum(f.calls for f in _adapters(model).installed) == 4
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("family", MOE)
def test_the_patched_moe_model_traces_whole_under_torch_compile_in_fp32(family):
    """transformers' own `test_generate_compile_model_forward_fullgraph` on a patched MoE model:
    torch's grouped GEMM has no fp32 path under torch.compile (its fake kernel refuses anything but
    bf16), which transformers' dispatcher knows; the plugin's experts must trace whole there too,
    and give stock's logits (fp32 round-off, `TOL`). Dynamo's own backend: the tracing is what fails."""
    model = build_tiny_model(family).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with stock_torch_kernels(family), torch.no_grad():
        stock = model(input_ids=ids).logits
    patch_model(model)
    torch._dynamo.reset()
    try:  # an unpacked batch runs the stock GDN forward: on transformers' PyTorch functions, as in its tests
        with stock_torch_kernels(family), torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids).logits
    finally:
        torch._dynamo.reset()
    assert rel(compiled, stock) <= TOL


@pytest.mark.parametrize("experts,key", [(256, torch.uint8), (512, torch.int16), (40000, torch.int64)])
def test_rows_sorted_by_expert_in_the_narrowest_key_give_the_int64_sort_and_the_counts(experts, key):
    """`sort_by_expert` against an independent reference: a stable sort of the int64 ids and the cumulative
    bincount. Exact (integers). Qwen3.5-MoE's 256 experts sort as uint8 (one radix pass on a GPU, where
    int64 took eight), Qwen3-Next's 512 as int16. Experts without rows, the last id, a token's k experts
    in any order, and no tokens at all."""
    from axolotl_fastqwen.layers.grouped_experts import sort_by_expert

    gen = torch.Generator().manual_seed(3)
    chosen = torch.randperm(experts, generator=gen)[:37]  # most experts get no row
    index = chosen[torch.randint(0, 37, (300, 8), generator=gen)]
    index[0] = experts - 1  # the largest id survives the narrowing
    for top_k_index in (index, index[:0]):
        ids, order, offsets = sort_by_expert(top_k_index, experts)
        flat = top_k_index.reshape(-1)
        assert ids.dtype == key and offsets.dtype == torch.int32 and offsets.shape == (experts,)
        assert torch.equal(order, torch.sort(flat, stable=True)[1])
        assert torch.equal(ids.long(), flat[order])
        assert torch.equal(offsets.long(), torch.cumsum(torch.bincount(flat, minlength=experts), 0))


@pytest.mark.parametrize("family", MOE)
def test_expert_lora_factors_cast_once_a_forward_give_the_per_call_casts_bits(family, monkeypatch):
    """bf16 experts with peft's fp32 expert adapters (no autocast: grouped GEMMs run in the experts'
    dtype): the factors of every wrapper are cast once a forward, `s·B` folded
    (`patching/lora_weight_copies.py`), where each call cast them and scaled the `[rows, rank]` product.
    lora_alpha = 2r: the loss, the auxiliary loss and every gradient are the per-call casts' bit for bit,
    and the casts and the scale's multiplies are gone from each call."""
    from axolotl_fastqwen.patching import lora_weight_copies
    from op_count import OpCount

    batch = _batch(build_tiny_model(family).config.vocab_size)
    runs = {}
    for copies in (False, True):
        model = _lora_model(family, 8).to(torch.bfloat16)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        with monkeypatch.context() as m:
            if not copies:
                m.setattr(lora_weight_copies.LoraWeightCopies, "_why_not", lambda self, d: "off: the test's control")
            patch_model(model, fused_lora=False, log=False)
            _step(model, batch)  # the first forward installs the factored forwards
            with OpCount() as ops:
                out, grads = _step(model, batch)
            adapters = _adapters(model)
            runs[copies] = (out, grads, ops.counts, adapters.copies.to_dict(), len(adapters.installed))
            unpatch_model(model)
    (ref, ref_grads, before, off, modules), (out, grads, after, on, _) = runs[False], runs[True]
    assert off["state"] == "off: the test's control" and on["state"] == "on" and on["layers"] == 2 * modules > 0
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.aux_loss, ref.aux_loss)
    assert set(grads) == set(ref_grads) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert all(g.dtype == torch.float32 for n, g in grads.items() if "lora_" in n)
    wrappers = 2 * modules  # gate_up_proj and down_proj
    assert before["_to_copy"] - after["_to_copy"] >= 4 * wrappers  # A and B cast, forward and backward
    assert before["mul"] - after["mul"] >= 2 * wrappers  # the [rows, rank] scale, forward and backward
