"""The offline tiny model: round-trip, chat template, generation, determinism, idempotence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.models.tiny import STAMP_FILE, _train_tokenizer, build_tiny_model

TEXTS = [
    "What is 123 + 45? <think>\n123 + 45 = 168.\n</think> \\boxed{168}",
    "It's \\frac{1}{2}, isn't it?!  Tabs\tand\r\nnewlines\n\n",
    "Ünïcode café 日本語 ∑ x² — ok",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_round_trip_with_auto_classes(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    # heads of 32: the smallest size vLLM's CPU attention supports
    assert model.config.num_attention_heads == 2 and model.config.num_key_value_heads == 1
    assert model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 200_000
    # transformers loads qwen2 tokenizers as Qwen2Tokenizer; it must encode like the original.
    original = _train_tokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == original(text)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_special_and_reasoning_tokens(tiny: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        assert tokenizer.convert_ids_to_tokens(tokenizer(token)["input_ids"]) == [token]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer("<think>\n1 + 2</think> \\boxed{3}<|im_end|>")["input_ids"]
    # </think> must survive skip_special_tokens (the reward looks for it); ChatML must not.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\n1 + 2</think> \\boxed{3}"
    digits = tokenizer.convert_ids_to_tokens(tokenizer("2025")["input_ids"])
    assert digits == ["2", "0", "2", "5"]


def test_chat_template_with_generation_prompt(tiny: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_generate(tiny: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=True, top_k=0)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 12
    assert all(0 <= t < len(tokenizer) for t in new.tolist())


def test_same_seed_same_model_other_seed_other_weights(tiny: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    weights = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_build_is_idempotent_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    target = tmp_path / "m"
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(target)
    assert torch.equal(torch.rand(3), expected)

    mtimes = {f.name: f.stat().st_mtime_ns for f in target.iterdir()}
    assert build_tiny_model(target) == target
    assert {f.name: f.stat().st_mtime_ns for f in target.iterdir()} == mtimes
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]  # no staging leftovers


def test_existing_directories(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (build_tiny_model(empty) / STAMP_FILE).is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    assert (foreign / "keep.txt").read_text() == "user data"
    with pytest.raises(FileExistsError):
        build_tiny_model(empty, seed=1)  # a build with another seed is not overwritten
