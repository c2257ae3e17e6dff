"""The real model's build (``drpo_openrlhf/models/smollm2.py``): the stamp that keeps or rebuilds a
cached build, the refusal of a missing or corrupted GGUF, the tokenizer's end-of-turn fix, and
the built directory itself (the session's ``smollm2`` fixture: ``make test`` builds it first).

The stamp and refusal tests swap the conversion (about 20-60 s) for a stand-in that writes two
small files, and the pinned SHA-256 for that of a small stand-in GGUF.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open
from toy_base import FIXTURES
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from drpo_openrlhf.models import smollm2 as real_model
from drpo_openrlhf.models.smollm2 import RealModelError, build, fix_tokenizer, stamp_problem
from drpo_openrlhf.runtime.tokenizer_check import tokenizer_problem

FAKE_GGUF = b"GGUF stand-in"


@pytest.fixture
def fake(tmp_path, monkeypatch) -> dict:
    """A stand-in GGUF whose SHA-256 is the pinned one, and a stand-in conversion that
    counts its calls."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(FAKE_GGUF)
    monkeypatch.setattr(real_model, "GGUF_SHA256", sha256(FAKE_GGUF))
    calls = []

    def convert(source: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"build": len(calls)}))
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(real_model, "convert", convert)
    return {"gguf": gguf, "calls": calls, "out": tmp_path / "cache" / "model"}


def build_number(out: Path) -> int:
    return json.loads((out / "config.json").read_text())["build"]


def leftovers(out: Path) -> list[str]:
    """Temporary build directories left beside ``out``."""
    return [p.name for p in out.parent.iterdir() if ".build-" in p.name]


def test_a_build_is_kept_while_its_stamp_matches(fake):
    out = build(fake["out"], gguf=fake["gguf"])
    assert out == fake["out"] and stamp_problem(out) is None
    assert build(out, gguf=fake["gguf"]) == out
    assert len(fake["calls"]) == 1  # the second call found the build
    assert json.loads((out / real_model.STAMP_FILE).read_text())["files"] == {
        "config.json": len(json.dumps({"build": 1})),
        "model.safetensors": len(b"weights"),
    }
    build(out, gguf=fake["gguf"], force=True)
    assert build_number(out) == 2 and not leftovers(out)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def another_release(out: Path, fake: dict, monkeypatch) -> None:
    fake["gguf"].write_bytes(b"another release")
    monkeypatch.setattr(real_model, "GGUF_SHA256", sha256(b"another release"))


def edit_stamp(out: Path, **changes) -> None:
    stamp = out / real_model.STAMP_FILE
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), **changes}))


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (lambda out, fake, mp: mp.setattr(real_model, "BUILDER_VERSION", 99), "other inputs"),
        (another_release, "other inputs"),
        (lambda out, fake, mp: edit_stamp(out, transformers="4.0.0"), "other inputs"),
        (lambda out, fake, mp: (out / "model.safetensors").write_bytes(b"cut"), "files are not"),
        (lambda out, fake, mp: (out / "config.json").unlink(), "files are not"),
        (lambda out, fake, mp: (out / real_model.STAMP_FILE).write_text("{"), "unreadable"),
    ],
    ids=["builder", "gguf", "transformers", "truncated", "missing-file", "bad-stamp"],
)
def test_a_stale_or_damaged_build_is_rebuilt(fake, monkeypatch, spoil, problem):
    out = build(fake["out"], gguf=fake["gguf"])
    spoil(out, fake, monkeypatch)
    assert problem in stamp_problem(out)
    build(out, gguf=fake["gguf"])
    assert build_number(out) == 2 and stamp_problem(out) is None and not leftovers(out)


def test_a_failed_build_keeps_the_last_one_and_leaves_no_partial_directory(fake, monkeypatch):
    out = build(fake["out"], gguf=fake["gguf"])

    def fail(source: Path, work: Path) -> None:
        (work / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(real_model, "convert", fail)
    with pytest.raises(OSError, match="disk full"):
        build(out, gguf=fake["gguf"], force=True)
    assert build_number(out) == 1 and stamp_problem(out) is None and not leftovers(out)


def test_a_corrupted_or_missing_gguf_is_refused_before_converting(fake):
    corrupted = fake["gguf"].with_name("corrupted.gguf")
    corrupted.write_bytes(FAKE_GGUF[:-1])
    with pytest.raises(RealModelError) as refused:
        build(fake["out"], gguf=corrupted)
    message = str(refused.value)
    assert "corrupted or another release" in message and real_model.GGUF_SHA256 in message
    assert real_model.INSTALL_HINT in message
    with pytest.raises(RealModelError, match="is missing: pip install"):
        build(fake["out"], gguf=fake["gguf"].with_name("gone.gguf"))
    assert not fake["calls"] and not fake["out"].exists() and not leftovers(fake["out"])


def test_a_missing_wheel_is_named_with_its_install_command(fake, monkeypatch):
    monkeypatch.setattr(real_model, "DISTRIBUTION", "drpo-no-such-distribution")
    with pytest.raises(RealModelError, match="drpo-no-such-distribution is not installed"):
        build(fake["out"])
    assert not fake["calls"]


def test_a_folder_without_a_stamp_is_not_replaced(fake):
    """A build appears whole with its stamp, so a folder with files and no stamp is not one
    (a mistyped ``--out``, say); an empty one is built into."""
    fake["out"].mkdir(parents=True)
    (fake["out"] / "notes.txt").write_text("mine")
    assert stamp_problem(fake["out"]) == "no build stamp"
    with pytest.raises(RealModelError, match=r"no drpo_build\.json: it is no build of this module"):
        build(fake["out"], gguf=fake["gguf"])
    assert (fake["out"] / "notes.txt").read_text() == "mine" and not fake["calls"]
    (fake["out"] / "notes.txt").unlink()
    build(fake["out"], gguf=fake["gguf"])
    assert build_number(fake["out"]) == 1


def test_the_cli_prints_the_directory_or_the_refusal(fake, capsys):
    build(fake["out"], gguf=fake["gguf"])
    real_model.main(["build", "--out", str(fake["out"])])
    assert capsys.readouterr().out.strip() == str(fake["out"])
    # no build there: the installed wheel's GGUF is not the stand-in whose digest is pinned
    with pytest.raises(SystemExit) as exited:
        real_model.main(["build", "--out", str(fake["out"].with_name("other"))])
    assert exited.value.code == 2
    assert "error: the model file" in capsys.readouterr().err
    assert len(fake["calls"]) == 1


def test_the_end_of_turn_becomes_eos_and_padding():
    """On the toy Qwen2 tokenizer (ChatML, ``<|im_end|>`` = 2), given the converted model's
    mistake (``<|im_start|>`` as EOS, no padding); a vocabulary without ``<|im_end|>`` at 2 is
    refused."""
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "qwen2")
    tokenizer.eos_token = "<|im_start|>"
    fix_tokenizer(tokenizer)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    with pytest.raises(RealModelError, match="not SmolLM2's vocabulary"):
        fix_tokenizer(AutoTokenizer.from_pretrained(FIXTURES / "llama"))


def test_the_converted_tokenizer_still_needs_the_fix():
    """transformers' GGUF conversion names ``<|im_start|>`` the EOS and sets no padding (when
    a release fixes that, ``fix_tokenizer`` is obsolete)."""
    gguf = real_model.installed_gguf()
    converted = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert (converted.eos_token_id, converted.pad_token) == (1, None)


def test_the_built_model_is_smollm2_with_its_end_of_turn(smollm2):
    assert stamp_problem(smollm2) is None
    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and str(config.dtype).endswith("bfloat16")
    generation = GenerationConfig.from_pretrained(smollm2)
    assert (generation.eos_token_id, generation.pad_token_id) == (2, 2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 2, 1)
    assert tokenizer_problem(smollm2) is None  # loads as its tokenizer.json encodes
    chat = [{"role": "user", "content": "What is 7 + 5?"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with safe_open(smollm2 / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        dtypes = {str(weights.get_slice(n).get_dtype()) for n in names}
    assert len(names) == 272 and "lm_head.weight" not in names and dtypes == {"BF16"}
