"""The shipped bases are what their recipes train: the tests' quick bases
(``tests/toy_base.py``) and the demo's bases of seeds 0-2 (``drpo_openrlhf/demo/bases.py``);
the demo and the toy sweep use a shipped base only while it fits; the SFT that makes them
trains the response only and learns."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import toy_base
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.demo import bases
from drpo_openrlhf.demo.bases import train_base
from drpo_openrlhf.demo.config import DemoConfig, make_problems, with_seed
from drpo_openrlhf.demo.sft import _batches, encode_pair, train_sft
from drpo_openrlhf.demo.toy_model import build_toy_model
from drpo_openrlhf.demo.toy_task import sample_traces

SAME_FILES = ("tokenizer.json", "chat_template.jinja")


def tokenizer_settings(model_dir: Path) -> dict:
    """tokenizer_config.json without how it was last loaded (``local_files_only``)."""
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings.pop("local_files_only", None)
    return settings


SHIPPED = [
    *((toy_base.FIXTURES / a, DemoConfig.quick(), a) for a in toy_base.ARCHITECTURES),
    *(
        (bases.SHIPPED / f"seed{s}", with_seed(DemoConfig(), s), "qwen2")
        for s in bases.SHIPPED_SEEDS
    ),
]


@pytest.mark.parametrize(
    ("shipped", "config", "architecture"),
    SHIPPED,
    ids=[f"{p.parent.name}-{p.name}" for p, *_ in SHIPPED],
)
def test_shipped_base_is_the_current_recipe_s(
    shipped: Path, config: DemoConfig, architecture: str, tmp_path: Path
) -> None:
    """A change to the demo's settings, the toy task or the toy model's files fails here until
    the bases are rebuilt (``python tests/toy_base.py``, ``python -m drpo_openrlhf.demo.bases``)."""
    stamp = json.loads((shipped / "stamp.json").read_text())
    assert stamp == bases.recipe(config, architecture), "rebuild the shipped base"
    init = build_toy_model(
        tmp_path,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=config.seed,
        architecture=architecture,
    )
    for name in SAME_FILES:
        assert (shipped / name).read_text() == (init / name).read_text(), name
    assert tokenizer_settings(shipped) == tokenizer_settings(init)
    ours, fresh = AutoConfig.from_pretrained(shipped), AutoConfig.from_pretrained(init)
    assert ours.to_diff_dict() == fresh.to_diff_dict()
    model = AutoModelForCausalLM.from_pretrained(shipped)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_the_demo_copies_the_shipped_base_that_fits_and_trains_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[DemoConfig] = []
    monkeypatch.setattr(bases, "build", lambda config, output, **_: trained.append(config))
    seed1 = with_seed(DemoConfig(), 1)
    assert bases.provide_base(seed1, tmp_path / "a") == "shipped" and not trained
    weights = "model.safetensors"
    assert (tmp_path / "a" / weights).read_bytes() == (
        bases.SHIPPED / "seed1" / weights
    ).read_bytes()
    assert bases.provide_base(seed1, tmp_path / "b", retrain=True) == "trained"
    other = [
        with_seed(DemoConfig(), 3),  # no shipped base
        replace(seed1, sft=replace(seed1.sft, steps=999)),
        replace(seed1, hidden_size=64),
        DemoConfig.quick(),  # the quick demo's base is the tests' fixture, not shipped here
    ]
    for config in other:
        assert bases.provide_base(config, tmp_path / "c") == "trained"
    assert trained == [seed1, *other]


def test_sft_labels_only_the_response_and_its_eos() -> None:
    config = DemoConfig.quick()
    tokenizer = AutoTokenizer.from_pretrained(toy_base.FIXTURES / "qwen2")
    problems, _ = make_problems(config)
    pairs = list(itertools.islice(sample_traces(random.Random(0), config.task, problems), 32))
    encoded = {tuple(ids): start for ids, start in (encode_pair(tokenizer, *p) for p in pairs)}
    input_ids, attention_mask, labels = next(_batches(iter(pairs), tokenizer, 4, random.Random(0)))
    for ids, mask, row in zip(input_ids, attention_mask, labels, strict=True):
        length = int(mask.sum())
        start = encoded[tuple(ids[:length].tolist())]  # where its prompt's template ends
        assert 0 < start < length - 1 and ids[length - 1] == tokenizer.eos_token_id
        assert torch.equal(row[start:length], ids[start:length])
        assert (row[:start] == -100).all() and (row[length:] == -100).all()


def test_sft_lowers_the_response_loss(tmp_path: Path) -> None:
    config = DemoConfig.quick()
    problems, _ = make_problems(config)
    init = build_toy_model(tmp_path / "init", hidden_size=64, seed=0)
    sft = replace(config.sft, steps=12, batch_size=8, warmup_steps=2)
    tuned = train_sft(
        init,
        tmp_path / "tuned",
        sample_traces(random.Random(0), config.task, problems),
        sft,
        progress=False,
    )

    def loss(model_dir: Path) -> float:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        pairs = sample_traces(random.Random(7), config.task, problems)
        input_ids, attention_mask, labels = next(_batches(pairs, tokenizer, 16, random.Random(7)))
        with torch.no_grad():
            return float(
                model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            )

    before, after = loss(init), loss(tuned)
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("architecture", toy_base.ARCHITECTURES)
def test_train_base_trains_the_configured_model(architecture: str, tmp_path: Path) -> None:
    """``train_base`` (the demo, the sweep, the GPU smoke and the shipped bases) at the
    config's size, architecture and seed, two SFT steps."""
    config = DemoConfig.quick()
    config = replace(config, sft=replace(config.sft, steps=2, batch_size=4, warmup_steps=1))
    problems, _ = make_problems(config)
    base = train_base(
        config, tmp_path / "init", tmp_path / "base", problems, architecture=architecture
    )
    built = AutoConfig.from_pretrained(base)
    assert (built.hidden_size, built.num_hidden_layers) == (config.hidden_size, config.num_layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "init"]  # no scratch left
    assert built.model_type == architecture
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "init")
    tuned = AutoModelForCausalLM.from_pretrained(base)
    moved = [
        not torch.equal(a, b) for a, b in zip(init.parameters(), tuned.parameters(), strict=True)
    ]
    assert all(moved)
