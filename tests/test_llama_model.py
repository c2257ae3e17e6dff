"""The tiny Llama (``tiny_model.py``, ``architecture="llama"``): the 8B recipe's architecture
(DeepSeek-R1-Distill-Llama-8B) and chat format, offline; and the entry point's refusal of a
local model whose tokenizer transformers would load as another one (``tokenizer_check.py``).
Through the real pipeline it runs in tests/test_e2e_pipeline.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_tiny_model import TEXTS  # the same awkward texts for both tokenizers
from time_bounds import scaled
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.eval.runner import encode_prompt
from drpo_openrlhf.models.tiny import (
    LLAMA_ASSISTANT,
    LLAMA_BOS,
    LLAMA_EOS,
    LLAMA_USER,
    build_tiny_model,
)
from drpo_openrlhf.runtime.tokenizer_check import check_tokenizer, tokenizer_problem


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", architecture="llama")


def with_tokenizer_class(model: Path, target: Path, name: str) -> Path:
    """A copy of ``model`` whose tokenizer_config.json names ``name``, as the 8B's does."""
    shutil.copytree(model, target)
    config = target / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": name}))
    return target


def test_the_8b_architecture(llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.model_type == "llama"
    assert not config.tie_word_embeddings and not config.attention_bias and not config.mlp_bias
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.num_attention_heads == 2 and config.num_key_value_heads == 1  # grouped
    names = [name for name, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith(".bias")]
    # untied: the LM head is its own tensor, sent to vLLM beside the embedding
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_the_tokenizer_loads_as_it_was_written(llama: Path) -> None:
    loaded = AutoTokenizer.from_pretrained(llama)
    raw = Tokenizer.from_file(str(llama / "tokenizer.json"))
    for text in TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert ids[0] == loaded.bos_token_id  # added by default, as Llama 3's tokenizer does
        assert loaded.decode(ids, skip_special_tokens=True) == text
    # Llama 3 splits digits in runs of up to three (Qwen2: one by one)
    assert [piece for piece, _ in raw.pre_tokenizer.pre_tokenize_str("2025")] == ["202", "5"]
    assert tokenizer_problem(llama) is None


def test_special_and_reasoning_tokens(llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama)
    assert tokenizer.bos_token == LLAMA_BOS
    assert tokenizer.eos_token == tokenizer.pad_token == LLAMA_EOS  # padding is EOS, as in 8B
    for token in (LLAMA_BOS, LLAMA_EOS, LLAMA_USER, LLAMA_ASSISTANT, "<think>", "</think>"):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_ids_to_tokens(ids) == [token]
    ids = tokenizer(f"<think>\n1 + 2</think> \\boxed{{3}}{LLAMA_EOS}")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\n1 + 2</think> \\boxed{3}"


def test_chat_template_like_r1_distill_llama(llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{LLAMA_BOS}{LLAMA_USER}What is 2 + 3?{LLAMA_ASSISTANT}"
    # the system text comes first without a marker; an earlier answer loses its thinking
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "<think>\n1 + 1 = 2\n</think>\n\\boxed{2}"},
        {"role": "user", "content": "2 + 2?"},
    ]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{LLAMA_BOS}Be brief.{LLAMA_USER}1 + 1?{LLAMA_ASSISTANT}\n\\boxed{{2}}{LLAMA_EOS}"
        f"{LLAMA_USER}2 + 2?{LLAMA_ASSISTANT}"
    )
    # what OpenRLHF and drpo-eval feed the engines: the template's BOS, and only that one
    ids = encode_prompt(tokenizer, "What is 2 + 3?")
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_a_copy_naming_llama_tokenizer_fast_is_refused(llama: Path, tmp_path: Path) -> None:
    """transformers 5 loads ``LlamaTokenizerFast`` over a byte-level tokenizer.json as a
    SentencePiece-style tokenizer: spaces vanish. A local copy of the 8B is exactly that."""
    bad = with_tokenizer_class(llama, tmp_path / "copy", "LlamaTokenizerFast")
    problem = tokenizer_problem(bad)
    assert problem is not None and "loads its tokenizer as LlamaTokenizer" in problem
    assert "names 'LlamaTokenizerFast'" in problem and "Whatis12" in problem
    with pytest.raises(ValueError, match=r"^--actor.model_name_or_path .*copy: transformers"):
        check_tokenizer(str(bad))
    # the fix the message names
    fixed = with_tokenizer_class(llama, tmp_path / "fixed", "PreTrainedTokenizerFast")
    assert tokenizer_problem(fixed) is None
    check_tokenizer(str(fixed))


def test_a_hub_id_or_a_directory_without_tokenizer_json_is_not_checked(tmp_path: Path) -> None:
    check_tokenizer("deepseek-ai/DeepSeek-R1-Distill-Llama-8B")  # no download, no error
    assert tokenizer_problem(tmp_path) is None


def test_the_entry_point_refuses_it_before_anything_starts(llama, tmp_path, capsys):
    from drpo_openrlhf import train

    bad = with_tokenizer_class(llama, tmp_path / "copy", "LlamaTokenizerFast")
    flags = ["--vllm.num_engines", "1", "--rollout.n_samples_per_prompt", "4"]
    flags += ["--rollout.batch_size", "4", "--train.batch_size", "16"]
    flags += ["--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "out")]
    train.parse(["--actor.model_name_or_path", str(llama), *flags])
    with pytest.raises(SystemExit) as refused:
        train.parse(["--actor.model_name_or_path", str(bad), *flags])
    assert refused.value.code == 2
    assert "loads its tokenizer as LlamaTokenizer" in capsys.readouterr().err


def test_vllm_llama_holds_every_sent_tensor_in_its_place(tmp_path: Path) -> None:
    """The weight check against vLLM's own ``LlamaForCausalLM`` (its ``load_weights`` fuses
    q/k/v and gate/up; the untied LM head is its own parameter, which a sync must fill):
    tests/llama_sync_layout.py in a process of its own. Four layers: the layout map runs the
    loaders for the first two and the embeddings, and layers 2 and 3 reuse it, giving the map
    that name-by-name loading gives."""
    llama = build_tiny_model(tmp_path / "model", architecture="llama")
    config = AutoConfig.from_pretrained(llama)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(llama)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("llama_sync_layout.py")), str(llama)],
        capture_output=True,
        text=True,
        timeout=scaled(600),  # a hang guard: 14 s measured (2 cores at load 3-6)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == []
    loads = result["loads"]
    assert loads["lm_head.weight"] == [["lm_head.weight", ""]]
    assert loads["model.layers.0.self_attn.k_proj.weight"] == [
        ["model.layers.0.self_attn.qkv_proj.weight", "k"]
    ]
    assert loads["model.layers.1.mlp.up_proj.weight"] == [
        ["model.layers.1.mlp.gate_up_proj.weight", "1"]
    ]
    assert result["without_head"] == ["vLLM parameter 'lm_head.weight' was not loaded by this sync"]
    per_layer = (result["names"] - 3) // 4  # all but the embeddings, final norm and LM head
    assert result["mapped"] == result["names"] - 2 * per_layer  # layers 2 and 3 reused
    assert result["same_map"]
    assert loads["model.layers.3.self_attn.v_proj.weight"] == [
        ["model.layers.3.self_attn.qkv_proj.weight", "v"]
    ]
