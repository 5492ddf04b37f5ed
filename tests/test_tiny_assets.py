"""The offline stand-ins every other test and the CPU demo rely on: tiny models of the real
architectures, the tokenizer with its chat template, the skewed datasets, the asset folder."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import statistics
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")

from axolotl_fastqwen import registry  # noqa: E402
from axolotl_fastqwen import transformers_functions as stock  # noqa: E402
from axolotl_fastqwen.transformers_functions import stock_torch_kernels  # noqa: E402
import tiny_assets as ta  # noqa: E402
from tiny_assets import scaled_mrope_section  # noqa: E402

ALL_MODELS = ta.FAMILIES + tuple(ta.VL_FAMILIES)


@pytest.fixture(params=ALL_MODELS)
def family(request):
    return request.param


@pytest.fixture
def stock_kernels(family):
    """fla is installed here and transformers dispatches to it even on CPU, where it crashes:
    run the modeling module on its own torch fallbacks for the duration of the test."""
    with stock_torch_kernels(ta.text_family(family)) as module:
        yield module


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return ta.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("assets")
    return out, ta.write_assets(out)


def _text_config(model):
    return model.config.get_text_config()


def _image_inputs(input_ids: torch.Tensor) -> dict:
    """One 16x16 image (4 patches of 8x8 -> 1 merged token) spliced into ``input_ids``."""
    ids = input_ids.clone()
    ids[0, 3] = ta.SPECIAL_TOKEN_IDS[ta.VISION_START]
    ids[0, 4] = ta.SPECIAL_TOKEN_IDS[ta.IMAGE_PAD]
    ids[0, 5] = ta.SPECIAL_TOKEN_IDS[ta.VISION_END]
    token_types = torch.zeros_like(ids)
    token_types[0, 4] = 1
    return dict(
        input_ids=ids,
        pixel_values=torch.randn(4, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1)),
        image_grid_thw=torch.tensor([[1, 2, 2]]),
        mm_token_type_ids=token_types,
    )


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def test_config_has_the_real_layout(family):
    """Kernels and packers are tested on these, so they must have the real models' structure."""
    config = _text_config(ta.build_tiny_model(family))
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads  # grouped value heads
    assert config.num_attention_heads == 2 * config.num_key_value_heads  # GQA
    assert config.linear_conv_kernel_dim == 4
    assert config.tie_word_embeddings is False
    assert config.use_cache is True  # transformers' default, kept on purpose (it disables masks)
    assert config.vocab_size == ta.TOKENIZER_VOCAB_SIZE
    assert (config.pad_token_id, config.eos_token_id) == (ta.PAD_TOKEN_ID, ta.EOS_TOKEN_ID)
    rope = config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["rope_theta"] == 1e7
    if config.model_type != "qwen3_next":
        assert rope["mrope_interleaved"] is True
        assert sum(rope["mrope_section"]) == int(config.head_dim * 0.25) // 2
        assert all(section > 0 for section in rope["mrope_section"])  # T, H and W all present
    if "moe" in config.model_type or config.model_type == "qwen3_next":
        assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
        assert config.shared_expert_intermediate_size > 0


def test_scaled_mrope_section_keeps_the_real_proportions():
    assert scaled_mrope_section(64) == [11, 11, 10]  # the real 27B: rotary dim 64
    assert scaled_mrope_section(8) == [2, 1, 1]
    assert scaled_mrope_section(4) == [1, 1, 0]
    assert sum(scaled_mrope_section(24)) == 12


def test_overrides_reach_the_config_and_keep_rope_valid():
    config = ta.tiny_config("qwen3_5", num_hidden_layers=8, head_dim=16, hidden_size=96)
    assert config.layer_types.count("full_attention") == 2
    assert config.hidden_size == 96
    assert sum(config.rope_parameters["mrope_section"]) == 2  # rotary dim 4 -> 2 frequencies
    assert ta.tiny_config("qwen3_5", vocab_size=128).pad_token_id is None  # ids only for 512


def test_weights_are_deterministic_and_seeded(family):
    first, again = ta.build_tiny_model(family), ta.build_tiny_model(family)
    other = ta.build_tiny_model(family, seed=1)
    state, state_again, state_other = first.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert any(not torch.equal(state[k], state_other[k]) for k in state)


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ta.build_tiny_model("qwen3_5")
    assert torch.equal(torch.rand(3), expected)


def test_constant_default_parameters_are_randomised(family):
    """A kernel that ignores a norm weight, dt_bias or A_log must change the output."""
    model = ta.build_tiny_model(family)
    checked = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("RMSNormGated"):
            assert not torch.allclose(module.weight, torch.ones_like(module.weight)), name
            checked.add("gated_norm")
        elif cls.endswith("RMSNorm") and "Vision" not in cls:  # x * (1 + w): default w = 0
            assert module.weight.std() > 0.05, name
            checked.add("norm")
        if hasattr(module, "A_log"):
            assert not torch.allclose(module.dt_bias, torch.ones_like(module.dt_bias)), name
            decay = torch.exp(-module.A_log.exp() * torch.nn.functional.softplus(module.dt_bias))
            assert decay.max() > 0.99, f"{name}: no long-memory head, packing leaks would hide"
            assert decay.min() < 0.95, f"{name}: no fast-forgetting head"
            checked.add("gdn")
    assert checked == {"gated_norm", "norm", "gdn"}


def test_forward_backward_on_cpu(family, stock_kernels):
    model = ta.build_tiny_model(family).train()
    ids = torch.randint(0, ta.PAD_TOKEN_ID, (2, 96), generator=torch.Generator().manual_seed(0))
    if family in ta.VL_FAMILIES:
        inputs = _image_inputs(ids[:1])
    else:
        inputs = dict(input_ids=ids)
    out = model(**inputs, labels=inputs["input_ids"])
    assert torch.isfinite(out.loss) and 4.0 < out.loss.item() < 9.0  # ~ln(512) for random weights
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # Routed experts nobody picked get no gradient in one small batch; everything else must.
    assert [n for n in no_grad if ".experts." not in n] == []


def test_vision_tower_feeds_the_language_model():
    """The VL checkpoint is not text-only in disguise: the image changes the logits."""
    model = ta.build_tiny_model(ta.VL_FAMILY)
    inputs = _image_inputs(torch.arange(10, 22)[None])
    blank = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
    with stock_torch_kernels(ta.text_family(ta.VL_FAMILY)), torch.no_grad():
        diff = (model(**inputs).logits - model(**blank).logits).abs().max()
    assert diff > 1e-2


def test_stock_torch_kernels_swaps_and_restores():
    module = stock.modeling_module("qwen3_5")
    before = {name: getattr(module, name) for name in stock.KERNEL_GLOBALS}
    for name, current in before.items():
        fn = stock.torch_fallback(current, name)
        assert fn.__module__ == module.__name__ and fn.__name__ == name
    with stock_torch_kernels("qwen3_5_text") as patched:
        assert patched is module
        for name in stock.KERNEL_GLOBALS:
            assert getattr(module, name) is not before[name]
        q = torch.randn(1, 8, 2, 16)
        g, beta = -torch.rand(1, 8, 2), torch.rand(1, 8, 2)
        out, _ = module.torch_chunk_gated_delta_rule(q, q, q, g=g, beta=beta)
        assert out.shape == q.shape
        with pytest.raises(ValueError, match="cu_seqlens"):
            module.torch_chunk_gated_delta_rule(
                q, q, q, g=g, beta=beta, cu_seqlens=torch.tensor([0, 4, 8])
            )
    assert {name: getattr(module, name) for name in stock.KERNEL_GLOBALS} == before


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == ta.TOKENIZER_VOCAB_SIZE
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == (ta.ENDOFTEXT, ta.PAD_TOKEN_ID)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == (ta.IM_END, ta.EOS_TOKEN_ID)
    assert tokenizer.bos_token is None
    for token, token_id in ta.SPECIAL_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode(
        "hello", add_special_tokens=False
    )  # no bos/eos added behind the user's back


@pytest.mark.parametrize(
    "text",
    [
        "The model can train fast, and the loss will go down.",
        "naïve café — 🚀 tabs\tand\nnewlines  double  spaces",
        "<|im_start|>user\nhi<|im_end|>\n",
        "1234567 + 89 = ?",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < ta.TOKENIZER_VOCAB_SIZE


def test_tokenizer_is_compact_on_its_text(tokenizer):
    """Lengths in the datasets are planned in words; that only works if words are short."""
    text = ta.generate_text(random.Random(5), 400)
    per_word = len(tokenizer.encode(text, add_special_tokens=False)) / 400
    assert abs(per_word - ta.TOKENS_PER_WORD) < 0.25
    for role in ("system", "user", "assistant"):
        assert len(tokenizer.encode(role, add_special_tokens=False)) == 1


def test_tokenizer_training_is_deterministic(tmp_path):
    ta.build_tokenizer(tmp_path / "a")
    ta.build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_chat_template_is_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_axolotl_masks_exactly_the_assistant_turns(tokenizer, tmp_path):
    """Axolotl's chat_template strategy (tokenizer_default template, roles_to_train: [assistant],
    train_on_eos: turn) must label the same tokens the template's {% generation %} block marks:
    each assistant reply plus its <|im_end|>, nothing of system/user turns."""
    pytest.importorskip("axolotl")
    from axolotl.loaders.tokenizer import load_tokenizer
    from axolotl.prompt_strategies.chat_template import load as load_chat_template
    from axolotl.utils.dict import DictDefault

    tokenizer.save_pretrained(tmp_path)
    ta.tiny_config("qwen3_5").save_pretrained(tmp_path)  # Axolotl reads the model config too
    cfg = DictDefault(
        tokenizer_config=str(tmp_path),
        base_model=str(tmp_path),
        chat_template="tokenizer_default",
        sequence_len=512,
        train_on_inputs=False,
    )
    axolotl_tokenizer = load_tokenizer(cfg)
    strategy = load_chat_template(
        axolotl_tokenizer,
        cfg,
        {"type": "chat_template", "roles_to_train": ["assistant"], "train_on_eos": "turn"},
    )
    path = ta.write_dataset(tmp_path / "chat.jsonl", 60, seed=3, multi_turn_fraction=0.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert any(len(row["messages"]) > 3 for row in rows)
    for row in rows:
        got = strategy.tokenize_prompt(row)
        oracle = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert got["input_ids"] == oracle["input_ids"]
        trained = [int(label != -100) for label in got["labels"]]
        assert trained == oracle["assistant_masks"]
        ends = [i for i, t in enumerate(got["input_ids"]) if t == ta.EOS_TOKEN_ID]
        assert sum(trained[i] for i in ends) == (len(row["messages"]) - 1) // 2


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------
def _lengths(tokenizer, path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows, sorted(ta._row_tokens(tokenizer, row) for row in rows)


def test_chat_lengths_are_lognormal_skewed(tokenizer, tmp_path):
    """Median ~60, long right tail up to 480: what a packer meets in real SFT data."""
    path = ta.write_dataset(tmp_path / "chat.jsonl", 400, tokenizer=tokenizer)
    rows, lengths = _lengths(tokenizer, path)
    median, p95 = statistics.median(lengths), lengths[int(0.95 * len(lengths))]
    assert 50 <= median <= 72
    assert 150 <= p95 <= 330
    assert 300 <= lengths[-1] <= 480  # the tail reaches the cap, never past it
    assert lengths[0] >= 16
    assert statistics.mean(lengths) > 1.2 * median  # right-skewed
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert all(m["content"].strip() for m in row["messages"])
    assert 0.03 < sum(len(r["messages"]) > 3 for r in rows) / len(rows) < 0.4


def test_completion_lengths_without_tokenizer_follow_the_estimate(tokenizer, tmp_path):
    path = ta.write_dataset(tmp_path / "c.jsonl", 300, kind="completion", median_tokens=80)
    rows, lengths = _lengths(tokenizer, path)
    assert set(rows[0]) == {"text"}
    assert abs(statistics.median(lengths) - 80) <= 12
    assert lengths[int(0.95 * len(lengths))] > 2.5 * statistics.median(lengths)


def test_datasets_are_deterministic(tmp_path):
    a = ta.write_dataset(tmp_path / "a.jsonl", 50, seed=7)
    b = ta.write_dataset(tmp_path / "b.jsonl", 50, seed=7)
    c = ta.write_dataset(tmp_path / "c.jsonl", 50, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    with pytest.raises(ValueError):
        ta.write_dataset(tmp_path / "d.jsonl", 5, kind="dpo")


def test_sampled_lengths_match_the_lognormal():
    lengths = ta.sample_lengths(
        random.Random(0), 20000, median=60, max_tokens=10**6, min_tokens=1, sigma=0.8
    )
    logs = [math.log(x) for x in lengths]
    assert abs(statistics.median(lengths) - 60) < 2
    assert abs(statistics.pstdev(logs) - 0.8) < 0.03


# ---------------------------------------------------------------------------------------------
# Asset folder
# ---------------------------------------------------------------------------------------------
def test_write_assets_layout_and_manifest(assets):
    out, paths = assets
    assert set(paths) == {
        "tokenizer", *ta.FAMILIES, *ta.VL_FAMILIES, "chat", "completion", "finetome", "vision_chat", "manifest",
    }
    assert {"qwen3_5_vl", "qwen3_5_moe_vl"} <= set(ta.VL_FAMILIES)
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["seed"] == ta.DEFAULT_SEED
    assert manifest["versions"]["transformers"] == __import__("transformers").__version__
    # the chat rows again in FineTome's layout (what Axolotl's Qwen3.5 examples read)
    chat = [json.loads(line) for line in paths["chat"].read_text().splitlines()]
    finetome = [json.loads(line) for line in paths["finetome"].read_text().splitlines()]
    assert [[(t["from"], t["value"]) for t in row["conversations"]] for row in finetome] == [
        [({"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), m["content"]) for m in row["messages"]]
        for row in chat]
    for family in ta.VL_FAMILIES:  # a vision-language checkpoint ships its processor
        processor = json.loads((paths[family] / "processor_config.json").read_text())
        assert processor["processor_class"] == "Qwen3VLProcessor"
    # image+text rows: multi-content messages, their images on disk; some rows with none, some with two
    rows = [json.loads(line)["messages"] for line in paths["vision_chat"].read_text().splitlines()]
    images = [[p["path"] for p in m[0]["content"] if p["type"] == "image"] for m in rows]
    assert len(rows) == ta.VISION_ROWS and {len(i) for i in images} == {0, 1, 2}
    assert all(Path(p).is_file() and Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for i in images for p in i)


def test_the_pngs_decode_to_the_pixels_written(tmp_path):
    """The standard-library PNG writer against an independent decoder (Pillow)."""
    image_lib = pytest.importorskip("PIL.Image")
    rgb = bytes(range(256))[: 9 * 6 * 3]  # 9 x 6 pixels, 3 channels, every byte different
    path = ta.write_png(tmp_path / "x.png", 9, 6, rgb)
    with image_lib.open(path) as image:
        assert image.size == (9, 6) and image.mode == "RGB" and image.tobytes() == rgb


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="loading Qwen3VLProcessor needs torchvision (the dev extra; not in the no-Axolotl cells)")
def test_the_vision_language_checkpoints_processor_loads(assets):
    from transformers import AutoProcessor

    _, paths = assets
    for family in ta.VL_FAMILIES:
        processor = AutoProcessor.from_pretrained(paths[family])
        assert type(processor).__name__ == "Qwen3VLProcessor"
        assert processor.image_processor.patch_size == 8 and processor.image_processor.merge_size == 2


def test_write_assets_checkpoints(assets):
    _, paths = assets
    for family in ta.ASSET_MODELS:
        files = {p.name for p in paths[family].iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
        assert "chat_template" in files or "chat_template.jinja" in files or json.loads(
            (paths[family] / "tokenizer_config.json").read_text()
        ).get("chat_template")
    assert len(paths["chat"].read_text().splitlines()) == ta.CHAT_ROWS


def test_write_assets_is_idempotent(assets):
    out, paths = assets
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert ta.write_assets(out) == paths
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps


def test_write_assets_rebuilds_a_stale_or_forced_folder(tmp_path):
    one = ("qwen3_5",)  # keep it quick: one model
    paths = ta.write_assets(tmp_path, families=one)
    manifest, weights = paths["manifest"], paths["qwen3_5"] / "model.safetensors"
    first = weights.stat().st_mtime_ns
    record = json.loads(manifest.read_text())
    record["versions"]["transformers"] = "0.0.0"  # as if the library had been upgraded
    manifest.write_text(json.dumps(record))
    ta.write_assets(tmp_path, families=one)
    assert json.loads(manifest.read_text())["versions"] == ta.expected_manifest()["versions"]
    rebuilt = weights.stat().st_mtime_ns
    assert rebuilt != first
    ta.write_assets(tmp_path, families=one)
    assert weights.stat().st_mtime_ns == rebuilt
    ta.write_assets(tmp_path, families=one, force=True)
    assert weights.stat().st_mtime_ns != rebuilt


def test_checkpoints_reload_offline_with_identical_weights(assets):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    out, paths = assets
    for family in ta.FAMILIES:
        loaded = AutoModelForCausalLM.from_pretrained(paths[family], local_files_only=True)
        fresh = ta.build_tiny_model(family).state_dict()
        assert type(loaded).__name__ == registry.family(family).causal_lm
        state = loaded.state_dict()
        assert state.keys() == fresh.keys()
        assert all(torch.equal(state[k], fresh[k]) for k in fresh)
        tok = AutoTokenizer.from_pretrained(paths[family], local_files_only=True)
        assert tok.chat_template == ta.CHAT_TEMPLATE and len(tok) == ta.TOKENIZER_VOCAB_SIZE
    vl = AutoModelForImageTextToText.from_pretrained(paths[ta.VL_FAMILY], local_files_only=True)
    fresh = ta.build_tiny_model(ta.VL_FAMILY).state_dict()
    assert type(vl).__name__ == "Qwen3_5ForConditionalGeneration"
    assert all(torch.equal(vl.state_dict()[k], fresh[k]) for k in fresh)
    # The text-only loader takes the language model out of the composite checkpoint intact.
    text = AutoModelForCausalLM.from_pretrained(paths[ta.VL_FAMILY], local_files_only=True)
    assert type(text).__name__ == "Qwen3_5ForCausalLM"
    for key, value in text.state_dict().items():
        in_composite = key if key.startswith("lm_head") else key.replace("model.", "model.language_model.", 1)
        assert torch.equal(value, fresh[in_composite]), key


def test_cli_writes_and_then_skips(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--families", "qwen3_next"]
    assert ta.main(argv) == 0
    assert (tmp_path / "qwen3_next" / "model.safetensors").exists()
    assert not (tmp_path / "qwen3_5").exists()
    stamp = (tmp_path / "MANIFEST.json").stat().st_mtime_ns
    assert ta.main(argv) == 0
    assert (tmp_path / "MANIFEST.json").stat().st_mtime_ns == stamp
    assert "qwen3_next" in capsys.readouterr().out
