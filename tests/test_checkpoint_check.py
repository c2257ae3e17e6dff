"""A real checkpoint's pitfalls caught before launch (``runtime/checkpoint_check.py``):
each broken copy of the toy base's files gives its message, naming the file and the fix, and
the good ones (a list of eos ids, Qwen's padded embedding, a RoPE scaling's reach) stay
silent. The copies hold no weights: the checks read only config and tokenizer files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from toy_base import FIXTURES

from drpo_openrlhf import train
from drpo_openrlhf.runtime.checkpoint_check import check_checkpoint, context

BASE = FIXTURES / "qwen2"  # ChatML: <|endoftext|> 0 (pad), <|im_start|> 1, <|im_end|> 2 (eos)
DELETE = object()


def copy_model(
    target: Path,
    *,
    drop: tuple[str, ...] = (),
    **changes: dict,
) -> Path:
    """The toy base's files but its weights in ``target``; ``changes`` maps a JSON file's
    stem (``config``, ``generation_config``, ``tokenizer_config``) to keys to set (DELETE:
    remove); ``drop`` names files left out."""
    target.mkdir(parents=True)
    for file in BASE.iterdir():
        if file.suffix != ".safetensors" and file.name not in drop:
            shutil.copy(file, target / file.name)
    for stem, settings in changes.items():
        file = target / f"{stem}.json"
        data = json.loads(file.read_text()) if file.is_file() else {}
        data.update(settings)
        file.write_text(json.dumps({k: v for k, v in data.items() if v is not DELETE}))
    return target


def test_the_toy_base_passes_silently(tmp_path):
    model = copy_model(tmp_path / "model")
    assert check_checkpoint(str(model), 512, chat_template=True) == []
    assert check_checkpoint(str(model), 128, chat_template=False) == []


def test_an_eos_the_generation_config_does_not_name_is_a_warning(tmp_path):
    """A GGUF-converted SmolLM2: the tokenizer names <|im_start|> as eos, the generation
    config <|im_end|>. vLLM stops at either, so the run survives: a warning."""
    model = copy_model(tmp_path / "gguf", tokenizer_config={"eos_token": "<|im_start|>"})
    [warning] = check_checkpoint(str(model), 512, chat_template=True)
    assert warning.startswith(f"{model}: the tokenizer's eos_token '<|im_start|>' (id 1)")
    assert "generation_config.json's eos_token_id ('<|im_end|>' (id 2))" in warning
    assert "vLLM ends a rollout at any of them" in warning
    assert 'Set "eos_token" in tokenizer_config.json' in warning
    # without generation_config.json vLLM reads config.json's: named there
    bare = copy_model(
        tmp_path / "bare", drop=("generation_config.json",), config={"eos_token_id": 1}
    )
    [warning] = check_checkpoint(str(bare), 512, chat_template=True)
    assert "is not among config.json's eos_token_id ('<|im_start|>' (id 1))" in warning


@pytest.mark.parametrize(
    "generation",
    [{"eos_token_id": [0, 2]}, {"eos_token_id": 2}, {"eos_token_id": DELETE}],
    ids=["a list, as Llama-3.1's", "the same id", "none"],
)
def test_an_eos_among_the_generation_configs_is_silent(tmp_path, generation):
    model = copy_model(tmp_path / "model", generation_config=generation)
    assert check_checkpoint(str(model), 512, chat_template=True) == []


def test_no_pad_token_is_a_warning(tmp_path):
    # null, not absent: Qwen2Tokenizer defaults an absent pad_token to <|endoftext|>
    model = copy_model(tmp_path / "model", tokenizer_config={"pad_token": None})
    [warning] = check_checkpoint(str(model), 512, chat_template=True)
    assert warning.startswith(f"{model}: the tokenizer has no pad_token")
    assert "OpenRLHF pads with its eos_token '<|im_end|>'" in warning
    assert '"pad_token" in tokenizer_config.json' in warning


def test_a_chat_template_flag_without_a_template_is_an_error(tmp_path):
    model = copy_model(tmp_path / "base", drop=("chat_template.jinja",))
    with pytest.raises(ValueError) as e:
        check_checkpoint(str(model), 512, chat_template=True)
    prefix = f"--actor.model_name_or_path {model}: --data.apply_chat_template: "
    assert str(e.value).startswith(f"{prefix}{model} has no chat template")
    assert "drop --data.apply_chat_template" in str(e.value)
    assert check_checkpoint(str(model), 512, chat_template=False) == []


def test_tokens_beyond_the_embedding_are_an_error(tmp_path):
    model = copy_model(tmp_path / "model", config={"vocab_size": 440})  # 444 tokens
    with pytest.raises(ValueError) as e:
        check_checkpoint(str(model), 512, chat_template=True)
    message = str(e.value)
    assert "the tokenizer has 444 tokens but config.json's vocab_size is 440" in message
    assert "(id 440)" in message and "and 1 more have no row in the model's embedding" in message
    assert "model.resize_token_embeddings(444)" in message


def test_a_padded_embedding_passes(tmp_path):
    """Qwen's: 151,936 rows for 151,665 tokens."""
    model = copy_model(tmp_path / "model", config={"vocab_size": 512})
    assert check_checkpoint(str(model), 512, chat_template=True) == []


def test_max_len_beyond_the_positions_is_an_error(tmp_path):
    """Qwen2.5-Math: 4,096 positions; the recipes' 1,024 + 8,192."""
    model = copy_model(tmp_path / "math", config={"max_position_embeddings": 4096})
    assert check_checkpoint(str(model), 4096, chat_template=True) == []
    with pytest.raises(ValueError) as e:
        check_checkpoint(str(model), 9216, chat_template=True)
    message = str(e.value)
    assert "--data.max_len 9216 (prompt + response; vLLM's max_model_len) is beyond the " in (
        message
    )
    assert f"context of {model}/config.json: 4096 positions. vLLM refuses" in message
    assert "Lower --data.max_len to 4096 or less" in message


ROPE = {"rope_theta": 10000.0}
YARN = {**ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def test_rope_scaling_extends_the_context_with_a_warning(tmp_path):
    model = copy_model(
        tmp_path / "yarn", config={"max_position_embeddings": 4096, "rope_parameters": YARN}
    )
    [warning] = check_checkpoint(str(model), 9216, chat_template=True)
    assert "beyond the 4096 positions" in warning
    assert "its yarn rope scaling x4 extends the context to 16384" in warning
    with pytest.raises(ValueError, match=r"4096 positions \(yarn rope scaling x4: 16384\)"):
        check_checkpoint(str(model), 20000, chat_template=True)


def test_the_limit_is_vllms():
    """As vLLM derives max_model_len: the factor multiplies (yarn: its original length),
    except for RoPE types whose max_position_embeddings already is the scaled one."""
    qwen_math = {"max_position_embeddings": 4096, "rope_theta": 10000.0}
    assert context(qwen_math) == (4096, 4096, "")
    llama31 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3"}}
    llama31["rope_scaling"].update(factor=8.0, original_max_position_embeddings=8192)
    assert context(llama31) == (131072, 131072, "")
    linear = {"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2}}
    assert context(linear) == (2048, 4096, "linear rope scaling x2")
    yarn = {"max_position_embeddings": 32768, "rope_parameters": {**YARN, "factor": 4.0}}
    assert context(yarn) == (32768, 16384, "yarn rope scaling x4")  # from its original 4096
    gpt2 = {"n_positions": 1024, "n_ctx": 1024}
    assert context(gpt2) == (1024, 1024, "")
    assert context({}) is None


def test_vllms_override_turns_the_error_into_a_warning(tmp_path, monkeypatch):
    model = copy_model(tmp_path / "math", config={"max_position_embeddings": 4096})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    [warning] = check_checkpoint(str(model), 9216, chat_template=True)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, so vLLM starts" in warning


def test_every_error_in_one_line(tmp_path):
    model = copy_model(
        tmp_path / "model",
        drop=("chat_template.jinja",),
        config={"vocab_size": 440, "max_position_embeddings": 256},
    )
    with pytest.raises(ValueError) as e:
        check_checkpoint(str(model), 512, chat_template=True)
    message = str(e.value)
    assert "\n" not in message and message.count(" Also: ") == 2


def test_a_config_that_is_not_json_is_named(tmp_path):
    model = copy_model(tmp_path / "model")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"^{re.escape(str(model))}/config.json: not JSON"):
        check_checkpoint(str(model), 512, chat_template=True)


def test_a_hub_id_is_read_from_the_cache_only(tmp_path, monkeypatch):
    """The recipes name Hub ids: checked when the cache has the files, never downloaded."""
    from huggingface_hub import constants

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--org--math"
    copy_model(repo / "snapshots" / revision, config={"max_position_embeddings": 4096})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"^--actor\.model_name_or_path org/math: --data\.max_len"):
        check_checkpoint("org/math", 9216, chat_template=True)
    assert check_checkpoint("org/math", 4096, chat_template=True) == []
    assert check_checkpoint("org/elsewhere", 9216, chat_template=True) == []  # not cached


FLAGS = [
    *("--vllm.num_engines", "1", "--rollout.n_samples_per_prompt", "4"),
    *("--rollout.batch_size", "4", "--train.batch_size", "16"),
    *("--rollout.max_new_tokens", "64", "--data.max_len", "128"),
]


def test_the_entry_point_refuses_errors_and_prints_warnings(tmp_path, capsys):
    flags = [*FLAGS, "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path)]
    base = copy_model(tmp_path / "base", drop=("chat_template.jinja",))
    with pytest.raises(SystemExit) as refused:
        train.parse(["--actor.model_name_or_path", str(base), "--data.apply_chat_template", *flags])
    assert refused.value.code == 2
    assert "--data.apply_chat_template: " in capsys.readouterr().err
    no_pad = copy_model(tmp_path / "no_pad", tokenizer_config={"pad_token": None})
    train.parse(["--actor.model_name_or_path", str(no_pad), "--data.apply_chat_template", *flags])
    err = capsys.readouterr().err
    assert f"drpo_openrlhf: warning: {no_pad}: the tokenizer has no pad_token" in err
