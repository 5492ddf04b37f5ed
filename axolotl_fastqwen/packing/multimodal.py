"""Image (and video) + text samples packed into the same static `[1, token_budget]` row.

transformers' Qwen-VL contract for a packed row (Qwen3.5 included): `position_ids` of shape
`[4, 1, T]`, row 0 the text positions (restarting per sequence: they mark the boundaries) and rows
1-3 the multimodal RoPE's temporal / height / width positions. Each sample's mRoPE positions come
from the model's own `get_rope_index` run on that sample alone (never across the row: an image's
positions continue from the text before it in its own sample). The vision inputs follow the text
row's order: `pixel_values` concatenated sample after sample with `image_grid_thw` to match (the
vision tower attends within each image only: it builds its own `cu_seqlens` from the grids), and
likewise `pixel_values_videos` / `video_grid_thw`. Placeholder tokens (one per merged patch) never
carry a label; an image is never split (the overlong setting applies to the whole sample).

Built on `PackedCollator`: the text row, its labels (the first label of every sample masked),
`cu_seq_lens_*`, `seq_idx` and the host copy of the boundaries are the text packer's, so a
multimodal row and a text row have the same boundaries for the same lengths.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from .collator import PackedCollator

IMAGE, VIDEO = 1, 2  # mm_token_type_ids: text 0, image 1, video 2 (the Qwen-VL processors' values)
# (pixel key, grid key, mm_token_type) of each vision modality, in the model's own names
MODALITIES = (("pixel_values", "image_grid_thw", IMAGE), ("pixel_values_videos", "video_grid_thw", VIDEO))

TEXT_KEYS = ("input_ids", "labels", "attention_mask", "fastqwen_filler")  # what the text packer takes and checks
RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class MultimodalSampleError(ValueError):
    """A sample whose vision inputs and placeholder tokens do not agree."""


def rope_index_of(model: nn.Module) -> RopeIndex:
    """The multimodal RoPE index of `model` (a Qwen-VL model, or a wrapper holding one): its own
    class's `get_rope_index`, bound to a copy of nothing but its config, so a collator holding it
    pickles into dataloader workers without the weights. Raises when the model has none."""
    owner = next((m for m in model.modules() if callable(getattr(type(m), "get_rope_index", None))), None)
    if owner is None:
        raise MultimodalSampleError(
            f"{type(model).__name__} has no get_rope_index: image or video inputs need a vision-language "
            "checkpoint (its model_type without the _text suffix, loaded as *ForConditionalGeneration).")
    cls = type(owner)
    stub = types.SimpleNamespace(config=owner.config,
                                 get_vision_position_ids=functools.partial(cls.get_vision_position_ids, None))
    return functools.partial(cls.get_rope_index, stub)


def merged_tokens(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Placeholder tokens each grid stands for: t * h * w / merge_size**2 (one per merged patch)."""
    grid = torch.as_tensor(grid_thw).reshape(-1, 3).long()
    return grid.prod(dim=1) // (merge_size * merge_size)


class MultimodalPackedCollator(PackedCollator):
    """`PackedCollator` for samples that may carry images or videos.

    Each feature: `input_ids` (placeholders expanded, as the Qwen-VL processors give them),
    optional `labels`, optional `mm_token_type_ids` (else derived from the placeholder ids), and
    for each image/video it holds, its rows of `pixel_values` / `pixel_values_videos` and its
    `image_grid_thw` / `video_grid_thw` rows. Returns what `PackedCollator` returns, with
    `position_ids` `[4, 1, B]`, `mm_token_type_ids` `[1, B]`, and the row's vision inputs (absent
    when the row holds none).

    `rope_index`: the model's `get_rope_index` (`rope_index_of(model)`); `image_token_id`,
    `video_token_id`, `merge_size`: the model config's placeholder ids and spatial merge size.
    """

    def __init__(self, token_budget: int, *, rope_index: RopeIndex, image_token_id: int,
                 video_token_id: int | None = None, merge_size: int = 2, pad_token_id: int = 0,
                 label_pad_token_id: int = -100):
        super().__init__(token_budget, pad_token_id=pad_token_id, label_pad_token_id=label_pad_token_id)
        self.rope_index = rope_index
        self.placeholder = {IMAGE: int(image_token_id)}
        if video_token_id is not None:
            self.placeholder[VIDEO] = int(video_token_id)
        self.merge_size = int(merge_size)

    def __call__(self, features: list[dict]) -> dict:
        samples = [self.sample(i, f) for i, f in enumerate(features) if len(f["input_ids"])]
        row = super().__call__([{k: v for k, v in s.items() if k in TEXT_KEYS} for s in samples])
        budget = self.token_budget
        text_positions = row["position_ids"].view(budget)
        mrope = text_positions.view(1, budget).expand(3, budget).clone()  # the tail: text positions
        types_row = torch.zeros(budget, dtype=torch.long)
        start = 0
        for s in samples:
            n = s["input_ids"].numel()
            types_row[start:start + n] = s["mm_token_type_ids"]
            mrope[:, start:start + n] = s["mrope"]
            start += n
        row["position_ids"] = torch.cat([text_positions.view(1, budget), mrope]).view(4, 1, budget)
        row["mm_token_type_ids"] = types_row.view(1, budget)
        for pixels, grid, _ in MODALITIES:
            parts = [s for s in samples if s.get(grid) is not None and s[grid].numel()]
            if parts:
                row[pixels] = torch.cat([s[pixels] for s in parts])
                row[grid] = torch.cat([s[grid] for s in parts])
        return row

    def sample(self, i: int, feature: dict) -> dict:
        """One feature as tensors, checked (the errors name it as sample `i`), its placeholders unlabelled,
        its own mRoPE positions."""
        ids = torch.as_tensor(np.asarray(feature["input_ids"]), dtype=torch.long).view(-1)
        types_ = feature.get("mm_token_type_ids")
        if types_ is None:
            types_ = torch.zeros_like(ids)
            for kind, token in self.placeholder.items():
                types_[ids == token] = kind
        else:
            types_ = torch.as_tensor(np.asarray(types_), dtype=torch.long).view(-1)
        out = {"input_ids": ids, "mm_token_type_ids": types_}
        if feature.get("attention_mask") is not None:
            out["attention_mask"] = feature["attention_mask"]
        if feature.get("fastqwen_filler"):
            out["fastqwen_filler"] = True
        grids = {}
        for pixels, grid, kind in MODALITIES:
            value = feature.get(grid)
            count = int((types_ == kind).sum())
            if value is None or not torch.as_tensor(value).numel():
                if count:
                    raise MultimodalSampleError(
                        f"sample {i}: {count} {_name(kind)} placeholder tokens but no {grid}: tokenize it with the "
                        "model's processor (which expands each placeholder to its patches) and keep its vision "
                        "inputs with it.")
                continue
            grid_t = torch.as_tensor(value).reshape(-1, 3).long()
            expected = int(merged_tokens(grid_t, self.merge_size).sum())
            if expected != count:
                raise MultimodalSampleError(
                    f"sample {i}: {count} {_name(kind)} placeholder tokens, but its {grid} {grid_t.tolist()} stands "
                    f"for {expected} (t*h*w/{self.merge_size}^2 per {_name(kind)}). The text and the vision inputs "
                    "come from different calls of the processor, or the text was truncated inside an image: "
                    "process each sample whole, once.")
            pixel_value = feature.get(pixels)
            if pixel_value is None:
                raise MultimodalSampleError(f"sample {i}: {grid} without {pixels}")
            pixel_t = torch.as_tensor(pixel_value)
            if pixel_t.shape[0] != int(grid_t.prod(dim=1).sum()):
                raise MultimodalSampleError(
                    f"sample {i}: {pixels} has {pixel_t.shape[0]} patch rows, its {grid} {grid_t.tolist()} needs "
                    f"{int(grid_t.prod(dim=1).sum())}")
            out[pixels], out[grid] = pixel_t, grid_t
            grids[grid] = grid_t
        labels = feature.get("labels")
        if labels is not None:
            labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).view(-1).clone()
            labels[types_ != 0] = self.label_pad_token_id  # a placeholder is an image patch, not a token to predict
            out["labels"] = labels
        elif not feature.get("fastqwen_filler"):
            labels = ids.clone()
            labels[types_ != 0] = self.label_pad_token_id
            out["labels"] = labels
        positions, _ = self.rope_index(ids.view(1, -1), types_.view(1, -1).int(), grids.get("image_grid_thw"),
                                       grids.get("video_grid_thw"))
        out["mrope"] = positions[:, 0]
        return out


def _name(kind: int) -> str:
    return "image" if kind == IMAGE else "video"
