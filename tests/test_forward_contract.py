"""The patched model on the paths users and the Hugging Face stack really take, against stock.

Every reference here is stock transformers on its PyTorch kernels (`stock_torch_kernels`), either
on the same batch (where stock is exact) or on each sequence run alone (where stock leaks). fp32
on CPU; tolerances as in test_patching.py: both sides do the same fp32 math in another order, so
1e-5 relative on logits, losses and the global gradient, 1e-4 on any single gradient tensor.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model
from axolotl_fastqwen.boundaries import BoundaryError
from axolotl_fastqwen.transformers_functions import stock_torch_kernels

from test_patching import (  # noqa: E402  (shared helpers of the patching tests)
    FAMILIES, TOL, alone_loss_and_grads, assert_grads_close, grads, loss_and_grads, model_for, packed_batch, rel,
    sequences,
)

MOE = ["qwen3_5_moe", "qwen3_next"]


def close(a, b, tol=TOL):
    return rel(a, b) <= tol


# ---- 1. return_dict=False ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_return_dict_false_gives_the_stock_tuple_loss_first(family):
    model = model_for(family)
    ids = torch.stack(sequences(model.config.vocab_size, [24, 24]))
    with stock_torch_kernels(family):
        stock = model(input_ids=ids, labels=ids, return_dict=False)
        stock_plain = model(input_ids=ids, return_dict=False)
    patch_model(model)
    ours = model(input_ids=ids, labels=ids, return_dict=False)
    plain = model(input_ids=ids, return_dict=False)
    assert isinstance(ours, tuple) and isinstance(plain, tuple)
    assert ours[0].dim() == 0 and close(ours[0], stock[0])  # the loss first
    assert close(plain[0], stock_plain[0])  # no labels: logits first, as stock


# ---- 2. logits: eval as stock, training None, logits_to_keep honoured ---------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_in_eval_equal_stock_and_are_none_in_training(family):
    model = model_for(family)
    ids = torch.stack(sequences(model.config.vocab_size, [30, 30]))
    with stock_torch_kernels(family):
        model.eval()
        stock_eval = model(input_ids=ids, labels=ids, use_cache=False)
        stock_last = model(input_ids=ids, logits_to_keep=1, use_cache=False)  # stock cannot add labels here
    patch_model(model)
    ours_eval = model(input_ids=ids, labels=ids, use_cache=False)
    assert ours_eval.logits.shape == stock_eval.logits.shape
    assert close(ours_eval.logits, stock_eval.logits) and close(ours_eval.loss, stock_eval.loss)
    model.train()
    train = model(input_ids=ids, labels=ids)
    assert train.logits is None and close(train.loss, stock_eval.loss)  # never an empty tensor
    kept = model(input_ids=ids, labels=ids, logits_to_keep=1)
    assert kept.logits.shape == stock_last.logits.shape and close(kept.logits, stock_last.logits)


def test_positional_labels_take_the_fused_path():
    model = model_for("qwen3_5")
    ids = sequences(model.config.vocab_size, [20])[0][None]
    with stock_torch_kernels("qwen3_5"):
        stock = model(input_ids=ids, labels=ids).loss
    patch_model(model)
    # forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels)
    out = model(ids, None, None, None, None, ids)
    assert out.logits is None and close(out.loss, stock)


# ---- 3. position_ids without a mask: only restarts are boundaries -------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequence_continuing_at_position_5_runs_as_stock(family):
    model = model_for(family)
    ids = sequences(model.config.vocab_size, [9])[0][None]
    pos = torch.arange(5, 14)[None]
    with stock_torch_kernels(family):
        stock = model(input_ids=ids, position_ids=pos, labels=ids)
        stock_logits = model(input_ids=ids, position_ids=pos).logits
    patch_model(model)
    assert close(model(input_ids=ids, position_ids=pos).logits, stock_logits)
    assert close(model(input_ids=ids, position_ids=pos, labels=ids).loss, stock.loss)


def test_restarting_position_ids_without_a_mask_are_packed_and_exact():
    model = model_for("qwen3_5")
    seqs = sequences(model.config.vocab_size, [12, 7, 20])
    with stock_torch_kernels("qwen3_5"):
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs]).detach()
    report = patch_model(model)
    pos = torch.cat([torch.arange(5, 5 + len(seqs[0]))] + [torch.arange(len(s)) for s in seqs[1:]])[None]
    packed = model(input_ids=torch.cat(seqs)[None], position_ids=pos).logits[0].detach()
    # the first sequence starts at 5 (a shift of RoPE positions changes nothing relative), the others restart
    assert close(packed, alone)
    assert any(s.startswith("position_ids") for s in report.boundary_sources)


# ---- 4. eval of packed rows, with or without a cache -------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_of_a_packed_row_with_the_default_cache_is_exact(family):
    from transformers import DynamicCache

    model = model_for(family)
    seqs = sequences(model.config.vocab_size)
    with stock_torch_kernels(family):
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs]).detach()
    patch_model(model)
    model.eval()
    batch = packed_batch(seqs)
    n = sum(map(len, seqs))
    assert model.config.use_cache  # the default: stock would build a cache and attend across sequences
    with torch.no_grad():
        out = model(**batch)
        assert out.logits is not None and close(out.logits[0, :n], alone)
        assert out.past_key_values is None
        with_cache = model(**batch, use_cache=True, past_key_values=DynamicCache(config=model.config))
    assert close(with_cache.logits[0, :n], alone)


def test_a_filled_cache_with_a_packed_row_is_refused():
    model = model_for("qwen3_5")
    model.eval()
    ids = sequences(model.config.vocab_size, [10])[0][None]
    with stock_torch_kernels("qwen3_5"):
        cache = model(input_ids=ids, use_cache=True).past_key_values
    patch_model(model)
    with pytest.raises(BoundaryError, match="cannot continue a cache"):
        model(**packed_batch(sequences(model.config.vocab_size)), past_key_values=cache)


# ---- 5. MoE: the router's auxiliary loss ---------------------------------------------------------


@pytest.mark.parametrize("family", MOE)
def test_moe_aux_loss_and_total_loss_equal_stock_on_an_unpacked_batch(family):
    model = model_for(family)
    ids = torch.stack(sequences(model.config.vocab_size, [32, 32]))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    with stock_torch_kernels(family):
        model.zero_grad(set_to_none=True)
        stock = model(**batch)
        stock.loss.backward()
        stock_grads = grads(model)
    assert float(stock.aux_loss) > 0 and model.router_aux_loss_coef > 0
    patch_model(model)
    model.zero_grad(set_to_none=True)
    ours = model(**batch)
    ours.loss.backward()
    assert close(ours.aux_loss, stock.aux_loss)
    assert close(ours.loss, stock.loss)  # the cross-entropy plus router_aux_loss_coef * aux_loss
    assert_grads_close(grads(model), stock_grads)


@pytest.mark.parametrize("family", MOE)
def test_moe_aux_loss_of_a_packed_row_counts_its_data_tokens_only(family):
    """Reference: stock's load-balancing function over the router logits of each sequence run alone
    (the tokens of the row that hold data), concatenated; the row's padding tail must not count."""
    model = model_for(family)
    seqs = sequences(model.config.vocab_size)
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    with stock_torch_kernels(family):
        per_seq = [model(input_ids=s[None], output_router_logits=True).router_logits for s in seqs]
    layers = tuple(torch.cat([r[i] for r in per_seq]) for i in range(len(per_seq[0])))
    expected = module.load_balancing_loss_func(layers, model.num_experts, model.num_experts_per_tok, None)
    patch_model(model)
    batch = packed_batch(seqs)  # 128 data tokens, 128 tokens of padding tail
    ours = model(**batch, output_router_logits=True)
    assert close(ours.aux_loss, expected)
    no_labels = model(**{k: v for k, v in batch.items() if k != "labels"}, output_router_logits=True)
    assert close(no_labels.aux_loss, expected)
    empty = packed_batch([], budget=64)  # a filler row: no data, trains nothing
    empty_out = model(**empty, output_router_logits=True)
    assert float(empty_out.aux_loss) == 0.0 and float(empty_out.loss) == 0.0


# ---- 6. Axolotl's own multipack batches -------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tiny_assets import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def _features(seqs, prompt=3):
    """Tokenized samples as Axolotl's chat datasets hold them: the prompt's labels masked."""
    return [{"input_ids": s.tolist(), "attention_mask": [1] * len(s), "position_ids": list(range(len(s))),
             "labels": [-100] * prompt + s[prompt:].tolist()} for s in seqs]


@pytest.mark.parametrize("collator_name", ["V2BatchSamplerDataCollatorForSeq2Seq", "BatchSamplerDataCollatorForSeq2Seq"])
def test_axolotl_multipack_batches_equal_each_sequence_alone(tokenizer, collator_name):
    """Axolotl's real multipack collators: two bins -> a [2, L] batch whose attention_mask holds
    per-sequence ids (V2) or ones (the other), position_ids restarting, padding to a multiple of 64."""
    collators = pytest.importorskip("axolotl.utils.collators.batching")
    model = model_for("qwen3_5")
    seqs = sequences(model.config.vocab_size, [37, 5, 70, 20, 41])
    bins = [[0, 1, 2], [3, 4]]
    collator = getattr(collators, collator_name)(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")
    batch = dict(collator([_features([seqs[i] for i in b]) for b in bins]))
    assert batch["input_ids"].shape == (2, 128) and "attention_mask" in batch
    labels = [torch.tensor(f["labels"]) for f in _features(seqs)]
    with stock_torch_kernels("qwen3_5"):
        alone_logits = [model(input_ids=s[None]).logits[0].detach() for s in seqs]
        model.zero_grad(set_to_none=True)
        alone_loss = 0.0
        for s, y in zip(seqs, labels):
            out = model(input_ids=s[None], labels=y[None], num_items_in_batch=torch.tensor(1))
            out.loss.backward()
            alone_loss += float(out.loss)
        alone_grads = grads(model)
    report = patch_model(model)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.detach()
    for row, members in enumerate(bins):
        start = 0
        for i in members:
            assert close(logits[row, start:start + len(seqs[i])], alone_logits[i])
            start += len(seqs[i])
    loss, packed_grads = loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(1))
    assert abs(float(loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(packed_grads, alone_grads)
    assert any(s.startswith("attention_mask") for s in report.boundary_sources)


def test_a_block_diagonal_4d_mask_packs_exactly_and_any_other_runs_as_stock():
    """Packing expressed as a custom 4-D mask: when it is the block-diagonal causal mask of the
    restarting position_ids, the row is packed (each sequence as alone: better than stock, whose
    recurrence ignores 4-D masks); any other 4-D mask (a shared-prefix tree, say) runs exactly as
    stock runs it, and the report says the recurrence could not follow it."""
    model = model_for("qwen3_5")
    seqs = sequences(model.config.vocab_size, [10, 6])
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor([10, 6]))
    blocks = ((seq[:, None] == seq[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril())[None, None]
    causal = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    with stock_torch_kernels("qwen3_5"):
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs]).detach()
        stock_causal = model(input_ids=ids, position_ids=pos, attention_mask=causal).logits.detach()
    report = patch_model(model)
    assert close(model(input_ids=ids, position_ids=pos, attention_mask=blocks).logits[0].detach(), alone)
    assert close(model(input_ids=ids, position_ids=pos, attention_mask=causal).logits.detach(), stock_causal)
    assert any("not the block-diagonal causal mask" in n for n in report.kernels.notes)


# ---- 7. left padding -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_each_sequence_alone(family):
    """Generation-style left padding: the mask marks the pads, position_ids count from each row's
    first real token (as `generate` computes them), pads' labels are -100."""
    model = model_for(family)
    seqs = sequences(model.config.vocab_size, [30, 17, 24])
    width = max(map(len, seqs))
    pad = 7  # not the embedding's padding_idx (a zero row): real checkpoints have trained pad embeddings
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0).masked_fill(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(len(seqs)), width - torch.tensor(list(map(len, seqs)))] = -100  # alone has no predecessor
    with stock_torch_kernels(family):
        alone = [model(input_ids=s[None]).logits[0].detach() for s in seqs]
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, family)
    patch_model(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.detach()
    for i, s in enumerate(seqs):
        assert close(logits[i, width - len(s):], alone[i])
    loss, ours = loss_and_grads(model, input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels,
                                num_items_in_batch=torch.tensor(1))
    assert abs(float(loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(ours, alone_grads)


# ---- 9. a step with no trainable token ----------------------------------------------------------


@pytest.mark.parametrize("num_items", [None, 0])
def test_a_step_with_no_trainable_token_gives_zero_loss_and_zero_gradients(num_items):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, target_modules=["in_proj_qkv", "q_proj"],
                                                             init_lora_weights=False))
    report = patch_model(model)
    batch = packed_batch(sequences(model.config.vocab_size))
    batch["labels"] = torch.full_like(batch["labels"], -100)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    out.loss.backward()
    assert torch.isfinite(out.loss) and float(out.loss) == 0.0
    g = grads(model)
    assert g and all(torch.isfinite(t).all() and not t.any() for t in g.values())
    assert report.context.warn_empty_forwards() == 1  # logged as a warning, and in the report:
    assert report.to_dict()["forwards_without_trainable_tokens"] == 1
    assert "training forwards without a trainable token (loss 0, no update): 1" in report.format()


# ---- Axolotl's fused LoRA projections inside the patched layers -------------------------------


def test_axolotl_fused_lora_projections_compose_exactly():
    """`lora_qkv_kernel` / `lora_o_kernel` attach fused LoRA autograd nodes to the attention and
    Gated DeltaNet modules; the patched layers call them. Against stock peft (no Axolotl kernels)
    on each sequence alone: same logits, loss and adapter gradients. (Its MLP kernel is Triton:
    GPU test.)"""
    pytest.importorskip("axolotl")
    from peft import LoraConfig, get_peft_model

    from axolotl.monkeypatch.lora_kernels import apply_lora_kernel_patches
    from axolotl.utils.dict import DictDefault

    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                             init_lora_weights=False, lora_dropout=0.0))
    seqs = sequences(model.config.vocab_size)
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, "qwen3_5")
    apply_lora_kernel_patches(model, DictDefault(lora_qkv_kernel=True, lora_o_kernel=True))
    base = model.get_base_model()
    calls = []
    gdn, attn = base.model.layers[0].linear_attn, base.model.layers[3].self_attn
    for module, name in ((gdn, "apply_in_proj_fused"), (gdn, "apply_out_proj"), (attn, "apply_qkv"), (attn, "apply_o")):
        fn = getattr(module, name)
        setattr(module, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    patch_model(model)
    loss, ours = loss_and_grads(model, **packed_batch(seqs), num_items_in_batch=torch.tensor(1))
    assert set(calls) == {"apply_in_proj_fused", "apply_out_proj", "apply_qkv", "apply_o"}
    assert abs(float(loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(ours, alone_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_a_cache_is_stock(family):
    """`generate` on a patched model (left-padded prompts, a recurrent + KV cache, transformers'
    cache argument under whichever name this version uses): the tokens stock generates, and the
    last step's logits."""
    model = model_for(family).eval()
    seqs = sequences(model.config.vocab_size, [9, 6])
    ids = torch.full((2, 9), 7)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, 9 - len(s):], mask[i, 9 - len(s):] = s, 1
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=7)
    with stock_torch_kernels(family), torch.no_grad():
        stock = model.generate(ids, **kw)
    patch_model(model)
    with torch.no_grad():
        ours = model.generate(ids, **kw)
    assert torch.equal(ours.sequences, stock.sequences)
    assert close(ours.logits[-1], stock.logits[-1])
