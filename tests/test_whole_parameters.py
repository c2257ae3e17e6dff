"""The exactness tests read ZeRO-3 weights back with ``testing.whole_parameters``; on gloo
DeepSpeed's own ``GatheredParameters`` returned uninitialised memory in about 2% of gathers
(it waits on the last of its async all-gathers only), which made those tests flaky."""

import pytest
import torch

from drpo_openrlhf.testing import free_port, spawn_ranks

GATHERS = 300  # at a 2% failure rate per gather, a racy gather passes this 0.2% of the time


def gather_repeatedly(rank: int, world: int, port: int, out: str) -> None:
    from drpo_actor_harness import Case, openrlhf_args, tiny_model

    from drpo_openrlhf import testing

    testing.set_rank_env(rank, world, port)
    strategy = testing.setup_strategy(openrlhf_args(Case(3, 2), world), "fp32")
    actor, _, _ = testing.prepare_actor(strategy, tiny_model())
    gathers = [testing.whole_parameters(actor.model.module, 3) for _ in range(GATHERS)]
    if rank == 0:
        torch.save(gathers, out)


@pytest.mark.slow
def test_zero3_weights_read_back_whole_every_time(tmp_path):
    from drpo_actor_harness import tiny_model

    out = str(tmp_path / "gathers.pt")
    spawn_ranks(gather_repeatedly, (2, free_port(), out), 2)
    expected = [p.detach().double() for p in tiny_model().parameters()]
    gathers = torch.load(out)
    assert len(gathers) == GATHERS
    bad = [i for i, got in enumerate(gathers) if not all(map(torch.equal, got, expected))]
    assert not bad, f"{len(bad)} of {GATHERS} gathers differ from the partitioned weights"
