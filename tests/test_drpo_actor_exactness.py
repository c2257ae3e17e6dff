"""The real DRPO update inside OpenRLHF's actor (DeepSpeed, gloo ranks) equals a one-piece,
single-process reference: same weights after the rollout's optimizer steps, for ZeRO 0/2/3,
several micro-batch sizes, packed and padded samples, dynamic batching with groups spread over
ranks, a short last rollout, one, two and four data-parallel ranks (groups dealt across them
as in the released code: rank r holds response r of every prompt when ranks = n), with the
log-probs computed in chunks (``--drpo.logprob_chunk_tokens``) or not, with a positive
reward other than length (``--drpo.positive_reward``: scores carried per response), and with
lambda set per prompt from its pass rate (``--drpo.lambda_by_pass_rate``, with and without
``--drpo.pass_rate_prior``), and with a rollout correction (``--algo.advantage.is_correction_*``:
the engines' log-probs' summaries carried per response)."""

import pytest
import torch
from drpo_actor_harness import (
    PROMPTS,
    TRAIN_BATCH,
    Case,
    N,
    assert_matches_reference,
    dynamic_microsteps,
    one_pass_expected,
    result,
    rollout,
    shared_results,
    whole_group_microsteps,
)

CASES = {
    1: [
        Case(0, 1),
        Case(2, 4),  # n = 4 rows: whole groups per micro-step, penalty pass when needed
        Case(3, 16),
        Case(2, 2, packing=True),
        Case(2, 8, kl_estimate="microstep"),
        Case(0, 4, chunk=5),  # chunks of 5 tokens, not dividing the padded rows
        Case(3, 2, packing=True, chunk=7),
        Case(2, 4, preference=True),
        # rollout correction: token weights on the scores and the KL, penalty pass
        Case(2, 4, correction=("token", "clip", "ratio", 0.5, 5.0)),
    ],
    2: [
        Case(2, 1),  # 2 rows per global micro-step cannot hold a group: scores pass
        Case(3, 2),
        Case(3, 8, packing=True),
        Case(2, 4, kl_estimate="microstep"),
        Case(3, 4, packing=True, kl_estimate="microstep"),
        Case(2, 2, kl_estimate="microstep"),  # groups split over both ranks, one pass
        Case(2, 1, kl_estimate="microstep"),
        Case(3, 1, packing=True, dynamic=True),
        Case(2, 1, packing=True, dynamic=True, kl_estimate="microstep"),
        Case(2, 1, dynamic=True),  # ZeRO-2 accumulates over dynamic micro-batches
        Case(2, 2, short=6),
        Case(3, 8, packing=True, chunk=3),  # ZeRO-3 gathers lm_head for every chunk
        Case(2, 1, packing=True, dynamic=True, kl_estimate="microstep", chunk=16),
        Case(2, 1, preference=True),  # scores pass, groups over both ranks
        Case(3, 2, packing=True, kl_estimate="microstep", preference=True),  # one pass
        Case(2, 1, packing=True, dynamic=True, preference=True),
        # lambda per prompt from its pass rate: the group's counts, wherever its rows are
        Case(2, 1, pass_rate_prior=4.0),  # scores pass, groups over both ranks
        Case(3, 2, packing=True, kl_estimate="microstep", pass_rate_prior=0.0),  # one pass
        # sequences masked, groups spread over the ranks, pi_old from the first forward
        Case(2, 1, packing=True, dynamic=True, correction=("seq", "mask", "ratio", 0.5, 2.0)),
    ],
    4: [  # rank r holds response r of every prompt (W = n), as in the released code
        Case(2, 1, kl_estimate="microstep"),
        Case(3, 1, packing=True, kl_estimate="microstep"),
        Case(3, 2),
        Case(2, 1, packing=True),
        # the truncated sequence weight in the group's sums, one pass, ZeRO-3
        Case(3, 1, kl_estimate="microstep", correction=("seq", "clip", "ratio", 0.5, 5.0)),
    ],
}


@pytest.fixture(scope="module")
def drpo_results(request, tmp_path_factory):
    """Shared with the other exactness modules: one spawn per world size for all of them."""
    return shared_results(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"), [(w, c) for w, cases in CASES.items() for c in cases], ids=str
)
def test_drpo_update_matches_one_piece_reference(drpo_results, world, case):
    assert_matches_reference(result(drpo_results, world, case), case, world)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w, cases in CASES.items() for c in cases if not c.dynamic and not c.short],
    ids=str,
)
def test_forwards_per_optimizer_step(drpo_results, world, case):
    """Forwards per rank: one per micro-batch when global micro-steps hold whole groups, plus
    the penalty pass's on the steps that needed it (mini-batch KL); otherwise the scores pass
    adds as many again on every optimizer step but the rollout's first."""
    got = result(drpo_results, world, case)
    steps = PROMPTS * N // TRAIN_BATCH
    micro_steps = TRAIN_BATCH // world // case.micro_batch_size
    status = got["status"]
    if not whole_group_microsteps(case, world):
        assert got["mode"] == "scores_pass"
        assert got["forwards"] == (2 * steps - 1) * micro_steps
        return
    assert got["mode"] == ("one_pass" if one_pass_expected(case, world) else "penalty_pass")
    penalty_steps = round(status["drpo/penalty_pass"] * steps)
    assert status["drpo/one_pass"] == pytest.approx(1 - penalty_steps / steps)
    if case.kl_estimate == "microstep":
        assert penalty_steps == 0
    assert got["forwards"] == (steps + penalty_steps) * micro_steps


@pytest.mark.slow
def test_penalty_pass_runs_only_when_the_minibatch_kl_exceeds_delta(drpo_results):
    """The first step of a rollout has KL 0 (no second pass); later ones here exceed delta."""
    for world, case in [(1, Case(2, 4)), (2, Case(3, 2)), (4, Case(3, 2))]:
        status = result(drpo_results, world, case)["status"]
        steps = PROMPTS * N // TRAIN_BATCH
        assert 0 < status["drpo/penalty_pass"] <= (steps - 1) / steps


@pytest.mark.slow
def test_dynamic_one_pass_runs_one_forward_per_global_micro_step(drpo_results):
    """No scores pass: every rank forwards once per packed micro-step of every step."""
    case = Case(2, 1, packing=True, dynamic=True, kl_estimate="microstep")
    got = result(drpo_results, 2, case)
    data = rollout()
    lengths = data["attention_mask"].sum(-1)
    groups_per_step = TRAIN_BATCH // N
    micro_steps = [
        dynamic_microsteps(
            case, 2, lengths, torch.nonzero(data["group"] // groups_per_step == k)[:, 0]
        )
        for k in range(PROMPTS // groups_per_step)
    ]
    assert all(len(m) > 1 for m in micro_steps)  # really packed into several micro-steps
    assert got["forwards"] == sum(len(m) for m in micro_steps)
