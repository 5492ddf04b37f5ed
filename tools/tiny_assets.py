"""Tiny, offline stand-ins for the Qwen hybrid models, their tokenizer and chat data.

No model hub is reachable where this project is developed and tested, so everything a test or
the CPU demo needs is generated here, deterministically, from code:

* ``tiny_config(family)`` / ``build_tiny_model(family)``: the real architectures (Gated DeltaNet
  with grouped value heads, gated full attention with GQA and partial interleaved MRoPE, MoE with
  a shared expert) at toy size, with weights random enough that a wrong kernel changes the output.
* ``build_tokenizer(out_dir)``: a byte-level BPE (Qwen's pre-tokenizer regex) with ChatML special
  tokens and a Qwen-style chat template that Axolotl's ``chat_template`` dataset type can mask.
* ``write_dataset(path, n)``: chat or completion JSONL whose token lengths are lognormal (skewed,
  like real SFT data), so a packer has something to pack.
* ``write_assets(out_dir)``: all of the above as ``base_model:``-ready folders plus a MANIFEST.

Stock (unpatched) forwards on CPU need ``axolotl_fastqwen.transformers_functions.stock_torch_kernels``: fla is
installed here and transformers picks it even on CPU, where it crashes.

CLI: ``python tools/tiny_assets.py --out .assets [--force]`` (tools/setup.sh runs it). Tests import
it from tools/ (tests/conftest.py puts the folder on sys.path); it is not part of the package.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from axolotl_fastqwen import registry

FAMILIES = tuple(f.name for f in registry.families())
VL_FAMILY = "qwen3_5_vl"  # the composite vision-language model, written by write_assets
# asset name -> text family, for every family with a vision-language checkpoint
VL_FAMILIES = {("qwen3_5_vl" if f.name == "qwen3_5" else f"{f.name}_vl"): f.name
               for f in registry.families() if f.conditional_generation}

DEFAULT_SEED = 0


def text_family(name: str) -> str:
    """The family an asset name belongs to (`qwen3_5_vl` -> `qwen3_5`; a family name as is)."""
    return VL_FAMILIES.get(name, name)

# ---------------------------------------------------------------------------------------------
# Tokenizer constants. Special tokens sit at the END of the vocabulary, as in the real Qwen
# tokenizers, so that "pad with id 0" bugs are not hidden by pad_token_id == 0.
# ---------------------------------------------------------------------------------------------
TOKENIZER_VOCAB_SIZE = 512
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
SPECIAL_TOKEN_IDS = {
    tok: TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, tok in enumerate(SPECIAL_TOKENS)
}
PAD_TOKEN_ID = SPECIAL_TOKEN_IDS[ENDOFTEXT]
EOS_TOKEN_ID = SPECIAL_TOKEN_IDS[IM_END]

# Qwen2/2.5/3/3.5 pre-tokenizer split (tokenizer.json of the real checkpoints).
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen renders it. The {% generation %} block (content + <|im_end|>) is what
# transformers' `return_assistant_tokens_mask` reports; it renders to nothing, so Axolotl (which
# locates turns by diffing renders) is unaffected, and tests can use it as an independent oracle
# for Axolotl's assistant-only labels.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ---------------------------------------------------------------------------------------------
# Models: toy sizes (one definition for these test models and the benchmark's tiny shapes); class
# names from each family's description.
# ---------------------------------------------------------------------------------------------
# Toy-size models: the real architectures at hidden 64. The test models below and the benchmark's
# toy shapes (fastqwen_bench/shapes.py, CPU smoke runs) are built from these numbers.
TOY_TEXT = dict(
    hidden_size=64,
    # Gated full attention, GQA 4 q / 2 kv. head_dim 32 -> rotary dim 8 -> 4 frequencies, the
    # smallest size at which all three interleaved MRoPE sections (T, H, W) are non-empty.
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    # Gated DeltaNet with grouped value heads (2 v per k; the 27B has 48 v / 16 k).
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=32768,
    # ~1/sqrt(hidden): every sub-layer contributes O(1) to the residual stream, so a kernel bug
    # in any layer shows in the logits (the 0.02 default leaves a 64-wide model nearly linear).
    initializer_range=0.1,
    tie_word_embeddings=False,
)
TOY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TOY_VOCAB = 512
REAL_MROPE_SECTION = (11, 11, 10)


def scaled_mrope_section(rotary_dim: int, real: tuple[int, ...] = REAL_MROPE_SECTION) -> list[int]:
    """Scale the real [11, 11, 10] section to ``rotary_dim // 2`` frequencies (largest remainder).

    The text rotary embedding interleaves T/H/W over ``rotary_dim // 2`` frequencies using the
    section lengths, so their sum must match the toy rotary dim or the model will not run.
    """
    n_freq = rotary_dim // 2
    if n_freq < 1:
        raise ValueError(f"rotary_dim {rotary_dim} has no frequencies")
    total = sum(real)
    exact = [s * n_freq / total for s in real]
    section = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(real)), key=lambda i: (-(exact[i] - section[i]), i))
    for i in by_remainder[: n_freq - sum(section)]:
        section[i] += 1
    return section


def toy_config(family: str, *, vocab_size: int = TOY_VOCAB, num_hidden_layers: int = 4, **overrides):
    """A toy-size text config of `family` with the real layer pattern (3 GDN : 1 full attention).

    `overrides` replace any field. Unless `rope_parameters` is overridden, the MRoPE section is
    recomputed from the final head_dim, so overriding the head size keeps it valid."""
    import transformers

    fam = registry.family(family)
    kwargs = dict(TOY_TEXT, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers)
    if fam.moe:
        kwargs.update(TOY_MOE)
    kwargs.update(dict(fam.toy))
    kwargs.update(overrides)
    if "rope_parameters" not in overrides:
        partial = kwargs.pop("partial_rotary_factor", 0.25)
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": partial}
        if fam.mrope:
            rope.update(mrope_section=scaled_mrope_section(int(kwargs["head_dim"] * partial)), mrope_interleaved=True)
        kwargs["rope_parameters"] = rope
    return getattr(transformers, fam.text_config)(**kwargs)


def _check_family(family: str, allowed: tuple[str, ...] = FAMILIES) -> None:
    if family not in allowed:
        raise ValueError(f"unknown family {family!r}; expected one of {allowed}")


def tiny_config(
    family: str, *, vocab_size: int = TOKENIZER_VOCAB_SIZE, num_hidden_layers: int = 4, **overrides
):
    """A tiny TEXT config of ``family`` with the real layer pattern (3 GDN : 1 full attention):
    ``toy_config`` with the tiny tokenizer's token ids (set only for the tokenizer's own vocabulary
    size). ``overrides`` replace any config field."""
    _check_family(family)

    ids = {}
    if vocab_size == TOKENIZER_VOCAB_SIZE:
        ids = dict(pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, bos_token_id=None)
    return toy_config(family, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers, **{**ids, **overrides})


def tiny_vl_config(family: str = "qwen3_5", **text_overrides):
    """A tiny composite vision-language config: ``Qwen3_5Config`` (or ``Qwen3_5MoeConfig`` for
    ``family="qwen3_5_moe"``) with the tiny text config inside. The real ``Qwen/Qwen3.5-*``
    checkpoints are of this kind (model_type ``qwen3_5`` / ``qwen3_5_moe``), and Axolotl loads
    them as ``*ForConditionalGeneration``.

    Vision: 1 block, width 32, 8x8 patches, 2x2 spatial merge; a 16x16 image is 4 patches -> 1
    ``<|image_pad|>`` token. Image/video/vision-start/end ids point at the tiny tokenizer's tokens.
    """
    import transformers

    _check_family(family, ("qwen3_5", "qwen3_5_moe"))
    text = tiny_config(family, **text_overrides)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=16,  # a 4x4 grid of learned positions, interpolated
        initializer_range=0.1,
    )
    config_cls = getattr(transformers, registry.family(family).composite_config)
    return config_cls(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=SPECIAL_TOKEN_IDS[IMAGE_PAD],
        video_token_id=SPECIAL_TOKEN_IDS[VIDEO_PAD],
        vision_start_token_id=SPECIAL_TOKEN_IDS[VISION_START],
        vision_end_token_id=SPECIAL_TOKEN_IDS[VISION_END],
        tie_word_embeddings=False,
    )


def _perturb_weights_(model, generator) -> None:
    """Move the parameters whose defaults are constants to random values near those defaults.

    Defaults (all-zero (1 + w) norms, all-one gated norms, dt_bias = 1) would make a kernel that
    ignores them look correct. A_log / dt_bias are set so that, at zero input, each layer's heads
    have half-lives spread log-uniformly (stratified) over 2..1000 tokens, with A in [1, 16]:
    some heads forget within a few tokens, some carry state across a whole sample, so state
    leaking across a packed-sequence boundary shows in the logits.
    """
    import torch

    def normal_like(p, mean, std):
        return torch.randn(p.shape, generator=generator, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for module in model.modules():
            cls = type(module).__name__
            if cls.endswith("RMSNormGated"):  # x * w, w defaults to ones
                module.weight.copy_(normal_like(module.weight, 1.0, 0.1))
            elif cls.endswith("RMSNorm") and "Vision" not in cls:  # x * (1 + w), w defaults to 0
                module.weight.copy_(normal_like(module.weight, 0.0, 0.1))
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                n = module.A_log.numel()
                strata = (torch.arange(n) + torch.rand(n, generator=generator)) / n
                strata = strata[torch.randperm(n, generator=generator)]
                half_life = torch.exp(math.log(2.0) + strata * (math.log(1000.0) - math.log(2.0)))
                a = torch.rand(n, generator=generator) * 15.0 + 1.0
                dt = math.log(2.0) / half_life / a  # decay per token exp(-a * dt) = 2^(-1/half_life)
                module.A_log.copy_(torch.log(a))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def build_tiny_model(family: str, *, seed: int = DEFAULT_SEED, dtype=None, **overrides):
    """The ``*ForCausalLM`` of ``family`` with deterministic random weights, in eval mode.

    ``family`` may also be ``"qwen3_5_vl"`` / ``"qwen3_5_moe_vl"`` (the
    ``*ForConditionalGeneration`` of ``tiny_vl_config``). ``overrides`` go to the (text) config.
    The global RNG state is left untouched.
    """
    import torch
    import transformers

    _check_family(family, FAMILIES + tuple(VL_FAMILIES))
    dtype = torch.float32 if dtype is None else dtype
    if family in VL_FAMILIES:
        config = tiny_vl_config(VL_FAMILIES[family], **overrides)
    else:
        config = tiny_config(family, **overrides)
    fam = registry.family(VL_FAMILIES.get(family, family))
    cls = getattr(transformers, fam.conditional_generation if family in VL_FAMILIES else fam.causal_lm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb_weights_(model, generator)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# Text generation from a short, fixed word list: the tiny BPE then spends a stable ~1.9 tokens
# per word, so a length planned in words lands close to the intended length in tokens.
# ---------------------------------------------------------------------------------------------
WORDS = tuple(
    """
    the a of to and in is it that for on with as was be at by this are from or have not but
    all can we they you he she one two new more time year day way work model data code test
    run fast slow long short good bad big small high low old first last next best each many
    some other such make take use find give tell ask show try keep let put set get go see
    know think want need look feel seem call move play turn help start stop read write load
    save train learn sum mean loss step batch token state head layer gate norm sort pack cut
    add mix map list file line word text page note plan goal idea fact case part rule task
    """.split()
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a careful tutor who explains each step.",
    "Answer the question using the notes.",
)
# Tokens of generated text per word, measured on the tiny tokenizer (words split into 1-3
# pieces, plus punctuation, capitals and numbers). Turns token targets into word counts.
TOKENS_PER_WORD = 1.9
# Tokens a ChatML message adds around its content: <|im_start|> role \n ... <|im_end|> \n
CHAT_MESSAGE_OVERHEAD = 5


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    if rng.random() < 0.15:
        words[rng.randrange(len(words))] = str(rng.randrange(1, 1000))
    if len(words) > 6 and rng.random() < 0.5:
        words[rng.randrange(2, len(words) - 2)] += ","
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!"))


def generate_text(rng: random.Random, n_words: int) -> str:
    """Sentences of 4-14 words totalling ``n_words`` words."""
    sentences, left = [], max(1, n_words)
    while left > 0:
        k = min(left, rng.randint(4, 14))
        sentences.append(_sentence(rng, k))
        left -= k
    return " ".join(sentences)


def _words_for_tokens(n_tokens: int) -> int:
    return max(1, round(n_tokens / TOKENS_PER_WORD))


def _tokenizer_training_corpus(seed: int) -> Iterator[str]:
    """Generated sentences, plus the ChatML role names and system prompts often enough that
    they become single tokens, as in the real vocabulary (template overhead ~5 tokens/turn)."""
    rng = random.Random(seed)
    for _ in range(300):
        yield from SYSTEM_PROMPTS
    for _ in range(3000):
        yield from ("system\n", "user\n", "assistant\n")
    for _ in range(2000):
        yield generate_text(rng, rng.randint(4, 40)) + rng.choice(("", "\n", "\n\n"))


def _train_tokenizer_object(seed: int):
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(list(_tokenizer_training_corpus(seed)), trainer=trainer)
    return tok


def build_tokenizer(out_dir: str | os.PathLike, *, seed: int = DEFAULT_SEED):
    """Train the tiny byte-level BPE (deterministic) and save it to ``out_dir``.

    Result: 512 tokens, specials last (``<|endoftext|>`` = pad, ``<|im_end|>`` = eos, no bos),
    ChatML ``chat_template``. Returns the loaded-back ``AutoTokenizer`` instance.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = _train_tokenizer_object(seed)
    added = tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if added != len(SPECIAL_TOKENS) or tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {TOKENIZER_VOCAB_SIZE}"
        )
    for text, expected in SPECIAL_TOKEN_IDS.items():
        if tok.token_to_id(text) != expected:
            raise RuntimeError(f"{text} got id {tok.token_to_id(text)}, expected {expected}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (ENDOFTEXT, IM_END)],
        model_max_length=32768,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------
CHAT_MEDIAN_TOKENS = 60
CHAT_MAX_TOKENS = 480
LENGTH_SIGMA = 0.8  # lognormal sigma: p95 ~ 3.7x median, p99 ~ 6.4x median (before clipping)


def sample_lengths(
    rng: random.Random, n: int, *, median: int, max_tokens: int, min_tokens: int, sigma: float
) -> list[int]:
    """Lognormal lengths ``median * exp(sigma * z)`` clipped to ``[min_tokens, max_tokens]``."""
    mu = math.log(median)
    return [
        int(min(max_tokens, max(min_tokens, round(rng.lognormvariate(mu, sigma))))) for _ in range(n)
    ]


def _chat_row(rng: random.Random, total_tokens: int, multi_turn_fraction: float) -> dict:
    system = rng.choice(SYSTEM_PROMPTS)
    system_tokens = len(system.split()) + 2  # its words are single tokens (see the corpus)
    turns = 2 if total_tokens >= 80 and rng.random() < multi_turn_fraction else 1
    overhead = CHAT_MESSAGE_OVERHEAD * (1 + 2 * turns) + system_tokens
    content = max(4 * turns, total_tokens - overhead)
    messages = [{"role": "system", "content": system}]
    per_turn = content / turns
    for _ in range(turns):
        user_share = rng.uniform(0.2, 0.5)  # assistants usually say more than users ask
        user_tokens = max(2, round(per_turn * user_share))
        assistant_tokens = max(2, round(per_turn) - user_tokens)
        messages.append({"role": "user", "content": generate_text(rng, _words_for_tokens(user_tokens))})
        messages.append(
            {"role": "assistant", "content": generate_text(rng, _words_for_tokens(assistant_tokens))}
        )
    return {"messages": messages}


def _row_tokens(tokenizer, row: dict) -> int:
    """Token length of a row as Axolotl will see it (chat rows: the rendered ChatML)."""
    if "messages" in row:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    else:
        text = row["text"]
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def write_dataset(
    path: str | os.PathLike,
    n: int,
    *,
    kind: str = "chat",
    seed: int = DEFAULT_SEED,
    median_tokens: int = CHAT_MEDIAN_TOKENS,
    max_tokens: int = CHAT_MAX_TOKENS,
    min_tokens: int = 16,
    sigma: float = LENGTH_SIGMA,
    multi_turn_fraction: float = 0.3,
    tokenizer=None,
) -> Path:
    """Write ``n`` JSONL rows whose tiny-tokenizer lengths are lognormal (skewed right).

    Length is per row, in tokens of the tiny tokenizer: for ``kind="chat"`` the whole ChatML
    rendering (system + user/assistant turns, ~25% two-turn when long enough), for
    ``kind="completion"`` the ``text``. Measured for the 400-row chat file of ``write_assets``
    (median 60, sigma 0.8, clip [16, 480]): median ~60, p95 ~235, p99 ~450, max ~480.
    Without ``tokenizer`` the lengths come from a words-per-token estimate (within ~10% on the
    median, a few rows may pass ``max_tokens`` slightly); with it, rows longer than
    ``max_tokens`` are regenerated shorter, so ``max_tokens`` is a hard limit.
    """
    if kind not in ("chat", "completion"):
        raise ValueError(f"kind must be 'chat' or 'completion', not {kind!r}")
    rng = random.Random(f"{kind}:{seed}")
    lengths = sample_lengths(
        rng, n, median=median_tokens, max_tokens=max_tokens, min_tokens=min_tokens, sigma=sigma
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for length in lengths:
            target = length
            while True:
                if kind == "chat":
                    row = _chat_row(rng, target, multi_turn_fraction)
                else:
                    row = {"text": generate_text(rng, _words_for_tokens(target))}
                n_tokens = _row_tokens(tokenizer, row) if tokenizer is not None else 0
                if n_tokens <= max_tokens:
                    break
                target = max(min_tokens, int(target * max_tokens / n_tokens * 0.97))
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def write_sharegpt(chat_path: Path, path: Path) -> Path:
    """The chat rows again in the layout of `mlabonne/FineTome-100k`, which Axolotl's Qwen3.5
    examples train on (`conversations` of `from` / `value`, roles `system` / `human` / `gpt`), so
    their dataset blocks run unchanged on a local file."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(chat_path, encoding="utf-8") as rows, open(tmp, "w", encoding="utf-8") as f:
        for line in rows:
            messages = json.loads(line)["messages"]
            turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in messages]
            f.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


VISION_ROWS = 48
IMAGE_SIDES = (16, 32, 48)  # pixels; 16 px = one merged patch of the tiny vision tower (1-9 tokens an image)


def write_png(path: Path, width: int, height: int, rgb: bytes, level: int = 9) -> Path:
    """An 8-bit RGB PNG of `rgb` (rows top to bottom), written with the standard library alone (the
    asset builder runs where no image library is installed)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))  # filter 0 per row
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, level)) + chunk(b"IEND", b""))
    return path


def write_vision_chat(path: Path, images_dir: Path, n: int = VISION_ROWS, seed: int = DEFAULT_SEED) -> Path:
    """Image+text chat rows in the multi-content `messages` format Axolotl's multimodal collator reads
    (`{"type": "image", "path": ...}` parts in a user turn), with random-pixel PNGs of a few sizes:
    most rows hold one image, some two, some none, so a packed row mixes all three."""
    rng = random.Random(f"vision:{seed}")
    images_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in range(n):
            parts = []
            for k in range(rng.choice((0, 1, 1, 1, 2))):
                h, w = rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)
                pixels = bytes(rng.randrange(256) for _ in range(h * w * 3))
                image = images_dir / f"{row}_{k}.png"
                write_png(image, w, h, pixels)
                parts.append({"type": "image", "path": str(image.resolve())})
            parts.append({"type": "text", "text": generate_text(rng, rng.randint(4, 16))})
            messages = [{"role": "user", "content": parts},
                        {"role": "assistant", "content": [{"type": "text", "text": generate_text(rng, rng.randint(3, 20))}]}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def write_processor(out: Path, config, *, min_image_tokens: int = 1, max_image_tokens: int = 64) -> Path:
    """`processor_config.json` of a vision-language checkpoint: Axolotl loads a processor for every
    multimodal model type (`qwen3_5`, `qwen3_5_moe`), even for text-only data. What
    `Qwen3VLProcessor.save_pretrained` writes, sized to the checkpoint's vision tower (the tiny one:
    8x8 patches, 2x2 merge, a 16x16 image is one image token). Images are resized to between
    `min_image_tokens` and `max_image_tokens` merged tokens (the published Qwen3.5 processor: 64 and
    16,384, i.e. 65,536 and 16,777,216 pixels at 32x32 pixels a token). Written as data, so no image
    backend is needed to write it (loading it needs torchvision)."""
    v = config.vision_config
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "merge_size": v.spatial_merge_size,
              "patch_size": v.patch_size, "resample": 3, "rescale_factor": 1 / 255,
              "temporal_patch_size": v.temporal_patch_size}
    unit = (v.patch_size * v.spatial_merge_size) ** 2  # pixels per image token
    processor = {
        "processor_class": "Qwen3VLProcessor",
        "image_processor": {**common, "image_processor_type": "Qwen2VLImageProcessor",
                            "size": {"shortest_edge": min_image_tokens * unit,
                                     "longest_edge": max_image_tokens * unit}},
        "video_processor": {**common, "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True,
                            "fps": 2, "min_frames": 2, "max_frames": 8, "max_video_tokens": 64,
                            "return_metadata": False,
                            "size": {"shortest_edge": unit, "longest_edge": 64 * unit * 2}},
    }
    path = out / "processor_config.json"
    path.write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# All assets
# ---------------------------------------------------------------------------------------------
CHAT_ROWS = 400
COMPLETION_ROWS = 400
COMPLETION_MEDIAN_TOKENS = 80


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "tokenizers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:  # pragma: no cover - these are hard dependencies
            out[dist] = "missing"
    return out


# the checkpoints write_assets writes by default: every family, and each vision-language checkpoint
# (the published Qwen3.5 checkpoints are of that kind, and Axolotl's examples load them as such)
ASSET_MODELS = FAMILIES + tuple(VL_FAMILIES)


def expected_manifest(
    seed: int = DEFAULT_SEED, families: tuple[str, ...] = ASSET_MODELS
) -> dict[str, Any]:
    """What ``MANIFEST.json`` must say for an existing asset folder to be reused. The hash of
    this file stands in for a format version: any change here rebuilds stale folders."""
    import hashlib

    return {
        "generator_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "seed": seed,
        "versions": _versions(),
        "families": list(families),
        "tokenizer_vocab_size": TOKENIZER_VOCAB_SIZE,
        "datasets": {
            "chat": {"rows": CHAT_ROWS, "median_tokens": CHAT_MEDIAN_TOKENS, "max_tokens": CHAT_MAX_TOKENS},
            "completion": {
                "rows": COMPLETION_ROWS,
                "median_tokens": COMPLETION_MEDIAN_TOKENS,
                "max_tokens": CHAT_MAX_TOKENS,
            },
        },
    }


def asset_paths(
    out_dir: str | os.PathLike, families: tuple[str, ...] = ASSET_MODELS
) -> dict[str, Path]:
    """Where ``write_assets(out_dir)`` puts each thing (no I/O)."""
    out = Path(out_dir)
    paths = {"tokenizer": out / "tokenizer"}
    for family in families:
        paths[family] = out / family
    paths["chat"] = out / "data" / "chat.jsonl"
    paths["completion"] = out / "data" / "completion.jsonl"
    paths["finetome"] = out / "data" / "finetome.jsonl"
    paths["vision_chat"] = out / "data" / "vision_chat.jsonl"
    paths["manifest"] = out / "MANIFEST.json"
    return paths


def _assets_current(paths: dict[str, Path], manifest: dict[str, Any]) -> bool:
    try:
        found = json.loads(paths["manifest"].read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    found.pop("created_unix", None)
    found.pop("seconds", None)
    return found == manifest and all(p.exists() for p in paths.values())


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Serialise concurrent writers (several test sessions may build .assets at once)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_assets(
    out_dir: str | os.PathLike,
    *,
    force: bool = False,
    seed: int = DEFAULT_SEED,
    families: tuple[str, ...] = ASSET_MODELS,
) -> dict[str, Path]:
    """Write ``tokenizer/``, one checkpoint folder per family (tokenizer files included, so
    ``base_model: <dir>`` alone works in Axolotl), ``data/chat.jsonl``,
    ``data/completion.jsonl`` and ``MANIFEST.json`` under ``out_dir``.

    Skips all work when MANIFEST matches this code, seed, families and library versions
    (unless ``force``); concurrent callers are serialised by a lock file. Returns the paths by
    name: tokenizer, one per checkpoint (`ASSET_MODELS`), chat, completion, finetome, vision_chat, manifest.
    """
    families = tuple(families)
    for family in families:
        _check_family(family, FAMILIES + tuple(VL_FAMILIES))
    out = Path(out_dir)
    paths = asset_paths(out, families)
    manifest = expected_manifest(seed, families)
    if not force and _assets_current(paths, manifest):
        return paths
    with _exclusive(out / ".lock"):
        if not force and _assets_current(paths, manifest):  # another process just built them
            return paths
        started = time.perf_counter()
        paths["manifest"].unlink(missing_ok=True)  # a half-written folder is never "current"
        for key in ("tokenizer",) + families:
            shutil.rmtree(paths[key], ignore_errors=True)
        tokenizer = build_tokenizer(paths["tokenizer"], seed=seed)
        for family in families:
            model = build_tiny_model(family, seed=seed)
            model.generation_config.pad_token_id = PAD_TOKEN_ID
            model.generation_config.eos_token_id = EOS_TOKEN_ID
            model.save_pretrained(paths[family])
            tokenizer.save_pretrained(paths[family])
            if family in VL_FAMILIES:
                write_processor(paths[family], model.config)
        write_dataset(paths["chat"], CHAT_ROWS, kind="chat", seed=seed, tokenizer=tokenizer)
        write_dataset(
            paths["completion"],
            COMPLETION_ROWS,
            kind="completion",
            seed=seed,
            median_tokens=COMPLETION_MEDIAN_TOKENS,
            tokenizer=tokenizer,
        )
        write_sharegpt(paths["chat"], paths["finetome"])
        write_vision_chat(paths["vision_chat"], out / "data" / "images", seed=seed)
        record = dict(manifest, created_unix=int(time.time()))
        record["seconds"] = round(time.perf_counter() - started, 2)
        tmp = paths["manifest"].with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, paths["manifest"])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/tiny_assets.py",
        description="Write the tiny offline Qwen hybrid checkpoints, tokenizer and datasets.",
    )
    parser.add_argument("--out", required=True, help="output folder, e.g. .assets")
    parser.add_argument("--force", action="store_true", help="rebuild even if MANIFEST matches")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--families",
        default=",".join(ASSET_MODELS),
        help=f"comma-separated checkpoints to write (default: {','.join(ASSET_MODELS)})",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    families = tuple(f for f in args.families.split(",") if f)
    paths = write_assets(args.out, force=args.force, seed=args.seed, families=families)
    for name, path in paths.items():
        print(f"{name:12s} {path}")
    print(f"done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
