"""The policy lag of a rollout (``algo/policy_lag.py``) and the weight versions every response
carries (``sync/weight_version.py``), without Ray: an engine stand-in whose version changes
while it generates, as a partial rollout's sync changes it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from drpo_openrlhf.algo.policy_lag import check_versions, fresh_rows, policy_lag
from drpo_openrlhf.sync.weight_version import (
    FIRST_KEY,
    LAST_KEY,
    WeightVersionEngine,
    pop_version_tags,
    response_versions,
)


def test_a_synchronous_rollout_has_no_lag_and_every_response_is_fresh():
    versions = [(3, 3)] * 4
    lag = policy_lag(versions, trained=3)
    assert lag.metrics() == {
        "drpo/policy_lag_max": 0.0,
        "drpo/policy_lag_min": 0.0,
        "drpo/policy_lag_mean": 0.0,
        "drpo/mixed_version_fraction": 0.0,
        "drpo/stale_response_fraction": 0.0,
    }
    assert lag.describe() == "policy lag 0"
    assert fresh_rows(versions, 3) == [True] * 4


def test_an_asynchronous_rollout_one_version_behind():
    lag = policy_lag([(2, 2)] * 3, trained=3)
    assert (lag.oldest, lag.newest, lag.mean, lag.stale, lag.mixed) == (1, 1, 1.0, 1.0, 0.0)
    assert lag.describe() == "policy lag 1"
    assert fresh_rows([(2, 2)], 3) == [False]


def test_a_partial_rollout_spans_versions():
    """Two responses paused by the sync to version 3 (started on 2, finished on 3), one
    started after it, one from before the sync before that."""
    versions = [(2, 3), (2, 3), (3, 3), (1, 2)]
    lag = policy_lag(versions, trained=3)
    assert (lag.oldest, lag.newest) == (2, 0)
    assert lag.mean == pytest.approx((1 + 1 + 0 + 2) / 4)
    assert lag.mixed == 0.75 and lag.stale == 0.75
    assert lag.describe() == "policy lag 0-2 (75% span versions)"
    assert fresh_rows(versions, 3) == [False, False, True, False]  # only whole version-3 ones


@pytest.mark.parametrize("versions", [[(4, 4)], [(3, 4)], [(2, 1)]])
def test_versions_no_trainer_can_see_are_bookkeeping_faults(versions):
    with pytest.raises(ValueError, match="weight-version bookkeeping is broken"):
        check_versions(versions, trained=3)
    with pytest.raises(ValueError, match="bookkeeping"):
        policy_lag(versions, trained=3)


def test_an_empty_rollout_has_no_lag():
    with pytest.raises(ValueError, match="without responses"):
        policy_lag([], trained=0)


class _Engine:
    """OpenRLHF's ``generate_responses`` for one prompt's two samples; ``during`` runs while
    they are generated (a sync pausing and resuming the engine)."""

    def __init__(self, during=None) -> None:
        self.during = during

    async def generate_responses(self, prompt, label, *args, **kwargs):
        if self.during:
            await self.during()
        return [{"extra_logs": {"positive": 0.5}}, {"extra_logs": None}]


class _VersionedEngine(WeightVersionEngine, _Engine):
    pass


def test_an_engine_tags_each_response_with_its_versions_at_request_and_return():
    engine = _VersionedEngine()
    with pytest.raises(RuntimeError, match="not told its weight version"):
        asyncio.run(engine.generate_responses("p", "l"))
    asyncio.run(engine.set_weight_version(2))
    outputs = asyncio.run(engine.generate_responses("p", "l"))
    assert [o["extra_logs"] for o in outputs] == [
        {"positive": 0.5, FIRST_KEY: 2, LAST_KEY: 2},
        {FIRST_KEY: 2, LAST_KEY: 2},
    ]

    async def sync():  # what a partial rollout's sync does meanwhile
        await engine.set_weight_version(3)

    engine.during = sync
    outputs = asyncio.run(engine.generate_responses("p", "l"))
    assert {(o["extra_logs"][FIRST_KEY], o["extra_logs"][LAST_KEY]) for o in outputs} == {(2, 3)}


def test_the_driver_reads_each_rows_versions_and_takes_them_out():
    batch = SimpleNamespace(
        info={FIRST_KEY: torch.tensor([2, 3]), LAST_KEY: [torch.tensor([3])] * 2}
    )
    assert response_versions(batch) == [(2, 3), (3, 3)]
    pop_version_tags([batch])
    assert batch.info == {}
    with pytest.raises(KeyError, match="without WeightVersionEngine"):
        response_versions(batch)
