"""Image+text samples packed into one row (`packing/multimodal.py`) against each sample alone.

The reference is stock transformers (its PyTorch kernels, `stock_torch_kernels`) running each
sample by itself, as its processor made it: the mRoPE positions computed by the model itself, the
vision tower on that sample's images only. The packed row goes through the patched model. fp32 on
CPU, tolerances as the text tests (test_patching.py): both sides do the same fp32 math in another
order, so 1e-5 relative on logits, loss and the global gradient, 1e-4 on any single gradient
tensor. The samples mix image sizes (several grids), two images in one sample and a text-only one,
with the vision tower and merger trained too, so their gradients are compared as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from axolotl_fastqwen import patch_model
from axolotl_fastqwen.packing.multimodal import (
    MultimodalPackedCollator, MultimodalSampleError, merged_tokens, rope_index_of,
)
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from test_patching import TOL, assert_grads_close, grads, model_for, rel

pytest.importorskip("torchvision")  # Qwen3.5's processor (its video half) needs it
VL = {"qwen3_5_vl": "qwen3_5", "qwen3_5_moe_vl": "qwen3_5_moe"}
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
# (text with one placeholder per image, image sizes in pixels): 16 px = one merged patch
SAMPLES = [
    (f"<|im_start|>user\nwhat is {PAD} here<|im_end|>\n<|im_start|>assistant\na red cat sits<|im_end|>\n",
     [(16, 32)]),
    (f"<|im_start|>user\ncompare {PAD} with {PAD}<|im_end|>\n<|im_start|>assistant\nthe left one is taller by far"
     "<|im_end|>\n", [(48, 32), (16, 16)]),
    ("<|im_start|>user\nno picture at all<|im_end|>\n<|im_start|>assistant\nthen I guess<|im_end|>\n", []),
    (f"<|im_start|>user\n{PAD}<|im_end|>\n<|im_start|>assistant\ntall<|im_end|>\n", [(64, 16)]),
]
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# a video sample: 4 frames of 32x32 (temporal patches of 2: a [2, 4, 4] grid, 8 placeholder tokens)
VIDEO_SAMPLE = (f"<|im_start|>user\nwatch {VIDEO} now<|im_end|>\n<|im_start|>assistant\nit moves<|im_end|>\n", (4, 32, 32))


@pytest.fixture(scope="module")
def processor():
    from tiny_assets import write_assets
    from transformers import AutoProcessor

    paths = write_assets(__import__("axolotl_runs").ROOT / ".assets")
    return AutoProcessor.from_pretrained(paths["qwen3_5_vl"])


def images(sizes, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


def processed(processor, samples=SAMPLES):
    """Each sample through the processor alone, as a training sample (labels = its input_ids). A
    sample whose sizes are one (frames, height, width) triple is a video."""
    out = []
    for k, (text, sizes) in enumerate(samples):
        if isinstance(sizes, tuple):
            frames = (np.random.default_rng(k).random((*sizes, 3)) * 255).astype("uint8")
            feature = processor(text=[text], videos=[frames], return_tensors="pt",
                                videos_kwargs={"do_sample_frames": False})
        else:
            feature = processor(text=[text], images=images(sizes, k) or None, return_tensors="pt")
        sample = {key: (value[0] if key in ("input_ids", "attention_mask", "mm_token_type_ids") else value)
                  for key, value in feature.items()}
        sample["labels"] = sample["input_ids"].clone()
        out.append(sample)
    return out


def collator_for(model, budget=256):
    config = model.config
    return MultimodalPackedCollator(budget, rope_index=rope_index_of(model), image_token_id=config.image_token_id,
                                    video_token_id=config.video_token_id,
                                    merge_size=config.vision_config.spatial_merge_size, pad_token_id=0)


def alone(model, text_family, samples):
    """Stock, each sample alone: logits (placeholders included), the summed loss, the gradients."""
    model.zero_grad(set_to_none=True)
    logits, total = [], 0.0
    with stock_torch_kernels(text_family):
        for s in samples:
            labels = s["labels"].clone()
            labels[s["mm_token_type_ids"] != 0] = -100  # placeholders never carry a label
            kwargs = {k: s[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
                      if k in s}
            out = model(input_ids=s["input_ids"][None], mm_token_type_ids=s["mm_token_type_ids"][None],
                        labels=labels[None], num_items_in_batch=torch.tensor(1), **kwargs)
            out.loss.backward()
            total += float(out.loss.detach())
            logits.append(out.logits[0].detach())
    return torch.cat(logits), total, grads(model)


def assert_row_trains_as_alone(model, row, alone_loss, alone_grads):
    """The packed row's loss (summed over its samples) and every gradient equal the samples' alone."""
    model.zero_grad(set_to_none=True)
    out = model(**row, num_items_in_batch=torch.tensor(1))
    out.loss.backward()
    assert abs(float(out.loss) - alone_loss) <= TOL * alone_loss
    assert_grads_close(grads(model), alone_grads)


@pytest.mark.parametrize("family", list(VL))
def test_a_packed_image_text_row_equals_each_sample_alone(family, processor):
    model = model_for(family)
    for p in model.parameters():  # the vision tower and merger train too: their gradients are compared
        p.requires_grad_(True)
    samples = processed(processor, [*SAMPLES, VIDEO_SAMPLE])
    alone_logits, alone_loss, alone_grads = alone(model, VL[family], samples)
    assert any(k.startswith("model.visual") for k in alone_grads)
    row = collator_for(model, budget=320)(samples)
    n = sum(s["input_ids"].numel() for s in samples)
    assert row["position_ids"].shape == (4, 1, 320) and row["image_grid_thw"].shape == (4, 3)
    assert row["video_grid_thw"].tolist() == [[2, 4, 4]] and row["pixel_values_videos"].shape[0] == 32
    patch_model(model)
    model.eval()
    no_labels = {k: v for k, v in row.items() if k != "labels"}
    assert rel(model(**no_labels).logits[0, :n].detach(), alone_logits) <= TOL
    model.train()
    assert_row_trains_as_alone(model, row, alone_loss, alone_grads)


def test_stock_leaks_across_a_packed_image_text_row(processor):
    """Control: the same row through the stock model (transformers' contract: 4-row position_ids,
    which isolate its attention but not its Gated DeltaNet) differs from the samples alone, so the
    comparison above can fail."""
    model = model_for("qwen3_5_vl")
    samples = processed(processor)
    alone_logits, _, _ = alone(model, "qwen3_5", samples)
    row = collator_for(model)(samples)
    n = sum(s["input_ids"].numel() for s in samples)
    model.eval()
    keep = ("input_ids", "position_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    with stock_torch_kernels("qwen3_5"):
        stock = model(**{k: row[k] for k in keep}).logits[0, :n].detach()
    assert rel(stock, alone_logits) > 1e-2


def test_the_row_layout(processor):
    """Row 0 of position_ids restarts per sample (the boundaries), rows 1-3 are each sample's own
    mRoPE positions, the vision inputs are concatenated in row order, placeholders and each
    sample's first token carry no label, and the padding tail is its own segment."""
    model = model_for("qwen3_5_vl")
    samples = processed(processor)
    row = collator_for(model, budget=192)(samples)
    lengths = [s["input_ids"].numel() for s in samples]
    cu = np.cumsum([0, *lengths])
    assert row["fastqwen_cu_seqlens_host"] == (*cu.tolist(), 192)
    positions = row["position_ids"][:, 0]
    rope = rope_index_of(model)
    for s, a in zip(samples, cu[:-1]):
        n = s["input_ids"].numel()
        assert positions[0, a:a + n].tolist() == list(range(n))
        own, _ = rope(s["input_ids"][None], s["mm_token_type_ids"][None].int(), s.get("image_grid_thw"), None)
        assert torch.equal(positions[1:, a:a + n], own[:, 0])
        assert row["labels"][0, a] == -100
        assert (row["labels"][0, a:a + n][s["mm_token_type_ids"] != 0] == -100).all()
    assert positions[0, cu[-1]:].tolist() == list(range(192 - cu[-1]))  # the tail counts from 0
    assert torch.equal(row["pixel_values"], torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s]))
    assert row["image_grid_thw"].tolist() == [[1, 2, 4], [1, 6, 4], [1, 2, 2], [1, 8, 2]]
    assert (row["mm_token_type_ids"][0, cu[-1]:] == 0).all()


def test_a_text_only_row_has_no_vision_inputs_and_text_positions_everywhere(processor):
    model = model_for("qwen3_5_vl")
    row = collator_for(model, 64)(processed(processor, [SAMPLES[2]]))
    assert "pixel_values" not in row and "image_grid_thw" not in row
    assert torch.equal(row["position_ids"][1], row["position_ids"][0]) and torch.equal(row["position_ids"][3],
                                                                                       row["position_ids"][0])


# ---- the bugs of other packers, replayed (LLaMA-Factory #7754, #10452, #10783) ---------------
def test_padding_inside_a_sample_is_refused_not_mis_positioned(processor):
    """#7754: mRoPE ids computed over an attention mask with padding inside a sample came out wrong.
    Here a sample is one unpadded sequence: padding inside it is refused, naming the sample."""
    model = model_for("qwen3_5_vl")
    sample = processed(processor, [SAMPLES[0]])[0]
    sample["attention_mask"] = sample["attention_mask"].clone()
    sample["attention_mask"][3] = 0
    with pytest.raises(ValueError, match="feature 0: attention_mask\\[3\\] = 0"):
        collator_for(model)([{**sample}])


def test_the_boundaries_of_a_multimodal_row_are_valid_for_the_gdn_kernels(processor):
    """#10452: invalid cu_seqlens crashed fla's GDN kernel. Ours start at 0, rise strictly, end at
    the budget, and agree with seq_idx and with row 0 of position_ids."""
    model = model_for("qwen3_5_vl")
    row = collator_for(model, 256)(processed(processor))
    cu = row["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == 256 and all(b > a for a, b in zip(cu, cu[1:]))
    seq_idx = row["seq_idx"][0]
    for k, (a, b) in enumerate(zip(cu, cu[1:])):
        assert (seq_idx[a:b] == k).all() and row["position_ids"][0, 0, a] == 0


@pytest.mark.parametrize("budget", [128, 192, 256])
def test_mrope_positions_always_cover_the_whole_row(processor, budget):
    """#10783: packed mRoPE ids were not padded to the padded length (shape mismatch). Every row
    here is [4, 1, budget] whatever the samples, the budget a multiple of 64."""
    model = model_for("qwen3_5_vl")
    samples = processed(processor)[:3] if budget == 128 else processed(processor)
    samples = [s for s in samples if sum(x["input_ids"].numel() for x in samples) <= budget]
    row = collator_for(model, budget)(samples)
    assert row["position_ids"].shape == (4, 1, budget) and row["input_ids"].shape == (1, budget)
    assert row["mm_token_type_ids"].shape == (1, budget)


# ---- bad input -----------------------------------------------------------------------------------
def test_placeholders_that_disagree_with_the_grid_are_refused_naming_the_sample(processor):
    model = model_for("qwen3_5_vl")
    samples = processed(processor)
    samples[1]["image_grid_thw"] = samples[1]["image_grid_thw"][:1]  # one grid for two images' tokens
    with pytest.raises(MultimodalSampleError, match="sample 1: 7 image placeholder tokens, but its image_grid_thw \\[\\[1, 6, 4\\]\\] stands for 6"):
        collator_for(model)(samples)
    samples = processed(processor)
    del samples[0]["pixel_values"], samples[0]["image_grid_thw"]
    with pytest.raises(MultimodalSampleError, match="sample 0: 2 image placeholder tokens but no image_grid_thw"):
        collator_for(model)(samples)


def test_images_need_a_vision_language_checkpoint():
    model = model_for("qwen3_5")  # the text-only *ForCausalLM
    with pytest.raises(MultimodalSampleError, match="has no get_rope_index: image or video inputs need a vision"):
        rope_index_of(model)


def test_merged_tokens_counts_one_per_merged_patch():
    assert merged_tokens(torch.tensor([[1, 2, 4], [2, 4, 4]]), 2).tolist() == [2, 8]


# ---- Axolotl's own processing, packed -------------------------------------------------------------
def test_axolotls_processed_samples_packed_equal_each_sample_alone():
    """The samples as Axolotl's multimodal collator makes them (its Qwen3.5 processing strategy:
    the qwen3_5 chat template, image loading, assistant-only labels), each alone through stock, and
    packed by the plugin's wrapper of that collator (integration/trainer_packing.MultimodalBins)."""
    pytest.importorskip("axolotl")
    import json

    from axolotl.processing_strategies import get_processing_strategy
    from axolotl.utils.chat_templates import get_chat_template
    from axolotl.utils.collators.mm_chat import MultiModalChatDataCollator
    from tiny_assets import write_assets
    from transformers import AutoProcessor

    from axolotl_fastqwen.integration.trainer_packing import MultimodalBins

    paths = write_assets(__import__("axolotl_runs").ROOT / ".assets")
    processor = AutoProcessor.from_pretrained(paths["qwen3_5_vl"])
    strategy = get_processing_strategy(processor, get_chat_template("qwen3_5"), "qwen3_5")
    rows = [json.loads(line) for line in paths["vision_chat"].read_text().splitlines()][:6]
    model = model_for("qwen3_5_vl")
    bins = MultimodalBins(MultiModalChatDataCollator(tokenizer=processor.tokenizer, processing_strategy=strategy),
                          collator_for(model, budget=512))
    samples = [bins.process(r) for r in rows]
    assert {len(s.get("image_grid_thw", [])) for s in samples} >= {0, 1}  # text-only and image samples
    assert all((s["labels"][s["mm_token_type_ids"] != 0] == -100).all() for s in samples)
    _, alone_loss, alone_grads = alone(model, "qwen3_5", samples)
    row = bins(rows)
    patch_model(model)
    assert_row_trains_as_alone(model, row, alone_loss, alone_grads)


def test_a_processor_that_does_not_match_the_model_is_refused(processor):
    """A processor whose patch merge differs from the model's (another checkpoint's processor): its
    placeholder counts disagree with what the model's vision tower makes of the grids."""
    model = model_for("qwen3_5_vl")
    samples = processed(processor)
    config = model.config
    mismatched = MultimodalPackedCollator(256, rope_index=rope_index_of(model), image_token_id=config.image_token_id,
                                          merge_size=1)
    with pytest.raises(MultimodalSampleError, match="sample 0: 2 image placeholder tokens, but its image_grid_thw"):
        mismatched(samples)


@pytest.mark.parametrize("family", list(VL))
def test_unpacked_image_text_batches_run_as_stock_runs_them(family, processor):
    """One image+text sample alone, and a right-padded batch of two (what Axolotl's multimodal
    collator gives with `fastqwen_packing: false`): the model computes its own mRoPE positions, a
    `[3, B, T]` tensor whose first row is the temporal position (constant across an image), which
    must not be read as packed-sequence boundaries. Logits equal stock's."""
    model = model_for(family).eval()
    samples = processed(processor)
    one = samples[1]
    padded = processor(text=[SAMPLES[0][0], SAMPLES[1][0]], images=images(SAMPLES[0][1], 0) + images(SAMPLES[1][1], 1),
                       return_tensors="pt", padding=True)
    batches = [{k: (v[None] if k in ("input_ids", "mm_token_type_ids") else v) for k, v in one.items()
                if k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")}, dict(padded)]
    with torch.no_grad(), stock_torch_kernels(VL[family]):
        stock = [model(**b).logits for b in batches]
    patch_model(model)
    with torch.no_grad():
        ours = [model(**b).logits for b in batches]
    assert rel(ours[0], stock[0]) <= TOL
    mask = batches[1]["attention_mask"].bool()
    assert rel(ours[1][mask], stock[1][mask]) <= TOL
