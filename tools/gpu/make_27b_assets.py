"""Write the offline assets for a real `axolotl train` of a Qwen3.5-27B-shaped model.

Writes, under --out:

* ``qwen3_5-27b-L<layers>/``: a ``Qwen3_5ForConditionalGeneration`` checkpoint (model_type
  ``qwen3_5``, as the real Qwen/Qwen3.5-27B: Axolotl's LoRA kernels look the attention class up by
  model_type and fail on ``qwen3_5_text``) with the published 27B text shapes
  (``fastqwen_bench.shapes``: hidden 5120, MLP 17408, 24 q / 4 kv heads of 256, GDN 16 key /
  48 value heads of 128, conv 4, vocab 248,320 untied, 3 GDN : 1 full attention, partial rotary
  0.25, interleaved MRoPE [11, 11, 10], theta 1e7) cut to ``--layers`` decoder layers, the vision
  tower at transformers' Qwen3.5 defaults (27 blocks of 1152, merger to 5120; frozen, unused by
  text-only data), the tokenizer (tiny_assets' local BPE: 512 tokens, ChatML specials; the
  embedding keeps all 248,320 rows) and the processor files (Axolotl loads a processor for every
  model_type it maps as multimodal, even for text-only data). Random bf16 weights are drawn on
  the GPU (``init_weights_``) with no CPU init pass, then ``save_pretrained``.
* ``data/chat.jsonl``: chat rows in the FineTome-100k layout the examples read
  (``conversations`` of ``{"from": "system"|"human"|"gpt", "value": ...}``) whose token lengths
  are lognormal (median ~500, sigma 1.0) clipped to ``--max-tokens``; enough rows for
  ``--steps`` packed steps of ``--budget`` tokens with a 1.4x margin.
* ``data/vision_chat.jsonl`` + ``data/images/`` (``--vision-rows N``, issue 34): image+text chat rows
  in the layout of Axolotl's Qwen3.5 vision example (llava-instruct-mix-vsft: multi-content
  ``messages``, ``{"type": "image", "path": ...}`` parts), with random-pixel PNGs at the sizes of
  that dataset's COCO photos (640x480, 480x640, 640x427, 500x375, 612x612, 640x360: 190-360 image
  tokens after the processor's resize to 32-pixel multiples); one image per sample, two in 10%;
  1-3 turns whose text is lognormal (median ~130 tokens). The processor files then carry the
  published Qwen3.5 resize limits (64 to 16,384 image tokens) instead of the tiny assets' 1 to 64.
* ``MANIFEST.json``: what was written, the length statistics and the timings.

Depth: the 64-layer checkpoint is 54 GB of bf16 (the disk there is 64 GiB, and an FFT's final
save would need as much again) and its steps take ~3-4 s; 8 layers keep the real layer shapes,
the real 248k-vocabulary head (the most expensive single matmul) and the 3:1 pattern (6 GDN, 2
attention) at 5.6 B text parameters (11.2 GB + 0.9 GB vision), ~0.3-0.45 s per 8k-token step.

CPU test: ``--tiny`` keeps the real vocabulary but toy widths (hidden 64), for a CPU ``axolotl
train`` of the same pipeline. Run it from the repository root (it imports ``axolotl_fastqwen``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path


def _tiny_assets():
    """tools/tiny_assets.py (the tokenizer and chat-data builders), beside this folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tiny_assets

    return tiny_assets


REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))



def text_config(layers: int, tiny: bool, vocab_size: int):
    import transformers

    from axolotl_fastqwen.diagnostics.model_shapes import SHAPES, layer_types
    ta = _tiny_assets()

    ids = dict(eos_token_id=ta.EOS_TOKEN_ID, pad_token_id=ta.PAD_TOKEN_ID, bos_token_id=None)
    if tiny:
        return ta.tiny_config(
            "qwen3_5", vocab_size=vocab_size, num_hidden_layers=layers, layer_types=layer_types(layers),
            initializer_range=0.02, **ids,
        )
    kwargs = dict(SHAPES["qwen3.5-27b"].config)
    kwargs["vocab_size"] = vocab_size
    return transformers.Qwen3_5TextConfig(
        num_hidden_layers=layers, layer_types=layer_types(layers), max_position_embeddings=262_144, **ids, **kwargs
    )


def vl_config(layers: int, tiny: bool, vocab_size: int, vision_depth: int | None):
    import transformers

    ta = _tiny_assets()

    text = text_config(layers, tiny, vocab_size)
    if tiny:
        vision = dict(depth=vision_depth or 1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                      num_position_embeddings=16)
    else:  # transformers' Qwen3_5VisionConfig defaults are the Qwen3.5 tower; the merger maps to 5120
        vision = dict(depth=27 if vision_depth is None else vision_depth)
    vision["out_hidden_size"] = text.hidden_size
    return transformers.Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=ta.SPECIAL_TOKEN_IDS[ta.IMAGE_PAD],
        video_token_id=ta.SPECIAL_TOKEN_IDS[ta.VIDEO_PAD],
        vision_start_token_id=ta.SPECIAL_TOKEN_IDS[ta.VISION_START],
        vision_end_token_id=ta.SPECIAL_TOKEN_IDS[ta.VISION_END],
        tie_word_embeddings=False,
    )


def write_checkpoint(out: Path, config, device: str, seed: int, dtype_name: str) -> dict:
    import torch
    import transformers

    from fastqwen_bench.shapes import _no_init, init_weights_

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_init():
            model = transformers.Qwen3_5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    init_weights_(model, seed, std=0.02)
    with torch.no_grad():
        for module in model.modules():  # the vision tower's LayerNorms: init_weights_ zeroes 1-D tensors
            if isinstance(module, torch.nn.LayerNorm):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    init_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    text_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    model.config.use_cache = True  # as the published config.json; training turns it off itself
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    started = time.perf_counter()
    model.save_pretrained(out, max_shard_size="4GB")
    save_s = time.perf_counter() - started
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"params": params, "text_params": text_params, "bytes": size, "init_s": round(init_s, 2),
            "save_s": round(save_s, 2)}


def _template_length(tokenizer, template: str | None):
    def length(messages: list[dict]) -> int:
        kwargs = {"chat_template": template} if template else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return length


def axolotl_template(name: str = "qwen3_5") -> str | None:
    """Axolotl's own chat template (what `chat_template: qwen3_5` renders), when Axolotl imports."""
    try:
        from axolotl.utils.chat_templates import get_chat_template

        return get_chat_template(name)
    except Exception:  # noqa: BLE001 - Axolotl absent or older: measure with the tokenizer's template
        return None


def write_chat_data(path: Path, tokenizer, *, steps: int, budget: int, median: int, sigma: float,
                    max_tokens: int, min_tokens: int, seed: int, rows: int | None, template: str | None) -> dict:
    ta = _tiny_assets()

    rng = random.Random(f"chat27b:{seed}")
    measure = _template_length(tokenizer, template)
    target_tokens = int(1.4 * steps * budget)
    lengths: list[int] = []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while (rows is None and sum(lengths) < target_tokens) or (rows is not None and len(lengths) < rows):
            want = ta.sample_lengths(rng, 1, median=median, max_tokens=max_tokens, min_tokens=min_tokens,
                                     sigma=sigma)[0]
            target, best = want, None
            for _ in range(8):  # the planned length is a words-per-token estimate: steer it onto `want`
                messages = ta._chat_row(rng, target, 0.3)["messages"]
                n = measure(messages)
                if n <= max_tokens and (best is None or abs(n - want) < abs(best[0] - want)):
                    best = (n, messages)
                if n <= max_tokens and abs(n - want) <= 0.08 * want + 8:
                    break
                target = max(min_tokens, int(target * min(want, max_tokens * 0.97) / n))
            if best is None:
                continue
            n, messages = best
            lengths.append(n)
            row = {"conversations": [{"from": ta.SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in messages]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    s = sorted(lengths)

    def q(p: float) -> int:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"rows": len(s), "tokens": sum(s), "median": q(0.5), "mean": round(sum(s) / len(s), 1), "p90": q(0.9),
            "p99": q(0.99), "max": s[-1], "min": s[0], "measured_with": "axolotl qwen3_5 template" if template
            else "tokenizer chat_template", "min_packed_rows": math.ceil(sum(s) / budget)}


PHOTO_SIZES = ((640, 480), (480, 640), (640, 427), (500, 375), (612, 612), (640, 360))  # width, height
VISION_TEXT_MEDIAN = 130  # tokens of text a sample, all turns together


def image_tokens(width: int, height: int, unit: int = 32) -> int:
    """Merged image tokens the Qwen3.5 processor gives a photo inside its pixel limits (each side
    rounded to a multiple of 32 pixels: 16-pixel patches, 2x2 merge)."""
    return max(1, round(height / unit)) * max(1, round(width / unit))


def write_vision_data(path: Path, images_dir: Path, rows: int, seed: int) -> dict:
    ta = _tiny_assets()

    rng = random.Random(f"vision27b:{seed}")
    images_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    n_images, tokens = 0, []
    with open(tmp, "w", encoding="utf-8") as f:
        for row in range(rows):
            k_images = 2 if rng.random() < 0.1 else 1
            text_tokens = ta.sample_lengths(rng, 1, median=VISION_TEXT_MEDIAN, max_tokens=1500, min_tokens=24,
                                            sigma=0.8)[0]
            turns = rng.choice((1, 1, 2, 3))
            per_turn = max(12, text_tokens // turns)
            messages, vision = [], 0
            for turn in range(turns):
                parts = []
                if turn == 0:
                    for k in range(k_images):
                        w, h = rng.choice(PHOTO_SIZES)
                        image = images_dir / f"{row}_{k}.png"
                        ta.write_png(image, w, h, rng.randbytes(w * h * 3), level=1)
                        parts.append({"type": "image", "path": str(image.resolve())})
                        vision += image_tokens(w, h) + 2
                        n_images += 1
                question = max(4, int(0.2 * per_turn / ta.TOKENS_PER_WORD))
                answer = max(4, int(0.8 * per_turn / ta.TOKENS_PER_WORD))
                parts.append({"type": "text", "text": ta.generate_text(rng, question)})
                messages += [{"role": "user", "content": parts},
                             {"role": "assistant", "content": [{"type": "text", "text": ta.generate_text(rng, answer)}]}]
            tokens.append(vision + text_tokens)
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    s = sorted(tokens)
    return {"rows": rows, "images": n_images, "approx_tokens": sum(s), "approx_median": s[len(s) // 2],
            "approx_max": s[-1], "image_sizes": [f"{w}x{h}" for w, h in PHOTO_SIZES],
            "note": "approx: image tokens from the resize rule plus the planned text tokens, before the chat template"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="assets folder, e.g. /tmp/fq27b")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (multiple of 4 keeps the 3:1 pattern)")
    p.add_argument("--vision-depth", type=int, default=None, help="vision blocks (default 27; tiny: 1)")
    p.add_argument("--tiny", action="store_true", help="toy widths (hidden 64), real vocabulary: CPU tests")
    p.add_argument("--vocab-size", type=int, default=248_320)
    p.add_argument("--device", default=None, help="where weights are drawn (default cuda if available)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60, help="packed steps the data must fill (x1.4 margin)")
    p.add_argument("--budget", type=int, default=8192, help="tokens per packed step")
    p.add_argument("--rows", type=int, default=None, help="exact row count (default: from --steps)")
    p.add_argument("--median", type=int, default=500)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=None, help="longest row (default budget - 256)")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--vision-rows", type=int, default=0, help="image+text chat rows to write (0: none)")
    p.add_argument("--force", action="store_true", help="rewrite even when MANIFEST matches")
    args = p.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    max_tokens = args.max_tokens or max(args.min_tokens, args.budget - 256)
    out = Path(args.out)
    name = f"qwen3_5-27b{'-tiny' if args.tiny else ''}-L{args.layers}"
    ckpt, data = out / name, out / "data" / "chat.jsonl"
    request = {"name": name, "layers": args.layers, "tiny": args.tiny, "vocab_size": args.vocab_size,
               "vision_depth": args.vision_depth, "dtype": args.dtype, "seed": args.seed, "steps": args.steps,
               "budget": args.budget, "rows": args.rows, "median": args.median, "sigma": args.sigma,
               "max_tokens": max_tokens, "min_tokens": args.min_tokens, "vision_rows": args.vision_rows,
               "generator_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    manifest_path = out / "MANIFEST.json"
    if not args.force and manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
        except ValueError:
            old = {}
        if old.get("request") == request and (ckpt / "config.json").exists() and data.exists():
            print(json.dumps({"reused": str(manifest_path), "checkpoint": str(ckpt), "data": str(data),
                              "vision_data": old.get("vision_data")}))
            return 0
    t0 = time.perf_counter()
    manifest_path.unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)

    ta = _tiny_assets()

    config = vl_config(args.layers, args.tiny, args.vocab_size, args.vision_depth)
    tokenizer = ta.build_tokenizer(ckpt, seed=args.seed)
    if args.tiny:
        ta.write_processor(ckpt, config)
    else:  # the published Qwen3.5 processor's limits
        ta.write_processor(ckpt, config, min_image_tokens=64, max_image_tokens=16_384)
    tok_s = time.perf_counter() - t0
    model_info = write_checkpoint(ckpt, config, device, args.seed, args.dtype)
    t1 = time.perf_counter()
    stats = write_chat_data(data, tokenizer, steps=args.steps, budget=args.budget, median=args.median,
                            sigma=args.sigma, max_tokens=max_tokens, min_tokens=args.min_tokens, seed=args.seed,
                            rows=args.rows, template=axolotl_template())
    vision_data, vision_stats = None, None
    if args.vision_rows:
        t2 = time.perf_counter()
        vision_data = out / "data" / "vision_chat.jsonl"
        vision_stats = write_vision_data(vision_data, out / "data" / "images", args.vision_rows, args.seed)
        vision_stats["write_s"] = round(time.perf_counter() - t2, 2)
    manifest = {"request": request, "checkpoint": str(ckpt), "data": str(data), "device": device,
                "vision_data": str(vision_data) if vision_data else None, "vision_dataset": vision_stats,
                "model": model_info, "dataset": stats, "tokenizer_s": round(tok_s, 2),
                "data_s": round(time.perf_counter() - t1, 2), "total_s": round(time.perf_counter() - t0, 2)}
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
