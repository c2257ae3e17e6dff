"""The actor's one-off forwards and gathers give the CUDA cache back before colocated vLLM
engines map their KV cache in (``sync_check.releasing_device_cache``): checked on CPU by
standing in for ``torch.cuda``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from drpo_openrlhf.sync import sync_check
from drpo_openrlhf.sync.sync_check import SentDigestsActor


@pytest.fixture
def events(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    return seen


def prober(events: list[str], fail: bool = False) -> SimpleNamespace:
    def forward(ids, mask, attention):
        events.append("forward")
        if fail:
            raise RuntimeError("out of memory")
        return torch.zeros(1, ids.shape[1] - 1)

    return SimpleNamespace(actor=SimpleNamespace(temperature=0.6), forward=forward)


def test_the_probe_releases_the_cache_after_its_forward(events):
    actor = prober(events)
    assert SentDigestsActor.probe_logprobs(actor, [1, 2, 3]) == [0.0, 0.0]
    assert events == ["forward", "empty_cache"]
    assert actor.actor.temperature == 0.6


def test_a_failed_probe_releases_it_too(events):
    with pytest.raises(RuntimeError, match="out of memory"):
        SentDigestsActor.probe_logprobs(prober(events, fail=True), [1, 2, 3])
    assert events == ["forward", "empty_cache"]


def test_the_start_up_weights_release_the_cache(events):
    model = torch.nn.Linear(3, 2)
    args = SimpleNamespace(ds=SimpleNamespace(tensor_parallel_size=1, zero_stage=0))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(args=args),
        actor=SimpleNamespace(model=SimpleNamespace(module=model)),
    )
    weights = SentDigestsActor.actor_weights(SimpleNamespace(trainer=trainer), digests=True)
    assert set(weights) == {"weight", "bias"} and weights["weight"][0] == (2, 3)
    assert events == ["empty_cache"]


def test_without_cuda_nothing_is_called(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("called without CUDA"))
    assert sync_check.releasing_device_cache(lambda: 7)() == 7
