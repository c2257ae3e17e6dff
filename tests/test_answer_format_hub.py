"""A Hub model's chat template read from the Hub's cache first, and a Hub that cannot be
reached answered at once, not after the Hub client's retries (``_hub_snapshot``).

The cache is a folder laid out as ``huggingface_hub`` lays it out (``refs/main``, a snapshot,
``.no_exist`` markers for files the repository does not have); the network is replaced by
functions that record their calls and fail as an unreachable host does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from drpo_openrlhf.rewards.answer_format import TEMPLATE_FILES, answer_format

CHATML = Path(__file__).parent / "fixtures" / "chat_templates" / "chatml"
MODEL = "someone/chatml-model"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, cached: list[str], missing: list[str]) -> None:
    """``root`` as a Hub cache holding ``cached`` (copied from the ChatML fixture, or an
    empty tokenizer config) and knowing that ``missing`` do not exist."""
    repo = root / f"models--{MODEL.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    for name in cached:
        target = repo / "snapshots" / REVISION / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = CHATML / name
        if source.is_file():
            shutil.copy(source, target)
        else:
            target.write_text("{}")
    for name in missing:
        marker = repo / ".no_exist" / REVISION / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


@pytest.fixture
def network(monkeypatch, tmp_path):
    """The Hub's cache in ``tmp_path/hub``; every request recorded and refused as by a host
    without internet."""
    calls: list[str] = []

    def unreachable(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            raise ConnectionError("[Errno -2] Name or service not known")

        return call

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in ("get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, unreachable(name))
    return calls


def test_a_fully_cached_template_is_read_without_a_request(network, tmp_path) -> None:
    others = [*TEMPLATE_FILES, "special_tokens_map.json"]
    fake_cache(tmp_path / "hub", ["tokenizer_config.json", "chat_template.jinja"], others[1:])
    decided = answer_format(MODEL)
    assert decided.name == "plain", decided
    assert "'<|im_start|>assistant\\n', opens no <think>" in decided.reason
    assert network == []


def test_an_unreachable_hub_reads_the_cache_after_one_request(network, tmp_path) -> None:
    """The cache does not know of the other template files: one request, refused, then the
    cached template (as transformers reads it offline)."""
    fake_cache(tmp_path / "hub", ["tokenizer_config.json", "chat_template.jinja"], [])
    decided = answer_format(MODEL)
    assert decided.name == "plain", decided
    assert network == ["get_hf_file_metadata"]  # the request without retries


def test_an_unreachable_hub_without_a_cache_keeps_the_default_at_once(network) -> None:
    """One refused request, no download attempts (each would wait out five retries)."""
    decided = answer_format(MODEL)
    assert decided.name == "thinking" and not decided.explicit
    assert f"cannot read the chat template of {MODEL} here (ConnectionError)" in decided.reason
    assert network == ["get_hf_file_metadata"]  # the request without retries
