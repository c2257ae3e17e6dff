"""The driver deals the rollout into the update's own micro-batches before OpenRLHF computes
the old log-probs, so that the actor forwards exactly the batches pi_old was scored in."""

import copy
from types import SimpleNamespace

import pytest
import torch
from drpo_actor_harness import PROMPTS, N, rollout

from drpo_openrlhf.testing import openrlhf_args, rollout_samples

PAD = 7  # the tokenizer's pad id: the driver pads with it, the actor's batches with 0


def dealt_batches(layout, longest_first=False, samples=None):
    from drpo_openrlhf.update.experience import deal_samples

    samples = rollout_samples(rollout()) if samples is None else samples
    for i, sample in enumerate(samples):
        sample.index = [i]
    return deal_samples(samples, layout, PAD, longest_first)


def chunks(batches: list, world: int) -> list[list]:
    """Each rank's experience batches, as OpenRLHF's ``async_run_method_batch`` cuts the list
    (contiguous chunks of ``ceil(len / world)``) for the old log-probs and for the update."""
    size = -(-len(batches) // world)
    return [batches[r * size : (r + 1) * size] for r in range(world)]


def actor_batches(batches: list, layout) -> list:
    """What one rank's update forwards from its chunk: OpenRLHF's replay buffer (split, right
    padding removed) and the DRPO actor's plan (``_plan_dealt``, ``make_experience_batch``)."""
    from openrlhf.trainer.ppo_utils.experience import (
        make_experience_batch,
        remove_padding_in_sequences,
        split_experience_batch,
    )

    from drpo_openrlhf.update.keys import SLOT_KEY
    from drpo_openrlhf.update.layout import plan_from_slots

    batches = copy.deepcopy(batches)  # the actors receive copies; the split drops ``index``
    items = [it for b in batches for it in remove_padding_in_sequences(split_experience_batch(b))]
    plan = plan_from_slots([int(it.info[SLOT_KEY]) for it in items], layout)
    return [make_experience_batch([items[i] for i in mb]) for step in plan for mb in step]


def assert_same_forward(old, new) -> None:
    """The two batches hold the same rows in the same order, padded to the same width: the
    same forward (padded tokens are masked; their id differs, ``PAD`` against 0)."""
    assert old.sequences.shape == new.sequences.shape
    assert torch.equal(old.attention_mask, new.attention_mask)
    assert torch.equal(old.action_mask.bool(), new.action_mask.bool())
    mask = old.attention_mask.bool()
    assert torch.equal(old.sequences[mask], new.sequences[mask])
    assert (old.sequences[~mask] == PAD).all() and (new.sequences[~mask] == 0).all()


@pytest.mark.parametrize(
    ("world", "micro"),
    [(2, 2), (4, 1), (1, 4)],
    ids=["2-ranks-micro2", "released-rank-per-response", "1-rank-micro4"],
)
def test_each_ranks_chunk_is_its_dealt_share_one_batch_per_micro_batch(world, micro):
    from drpo_openrlhf.update.keys import SLOT_KEY
    from drpo_openrlhf.update.layout import Layout, deal_rollout

    layout = Layout(world, N, PROMPTS, 16, micro)
    dealt = dealt_batches(layout)
    expected = deal_rollout([i // N for i in range(PROMPTS * N)], layout)
    for rank, batches in enumerate(chunks(dealt, world)):
        assert len(batches) == len(dealt) // world == 2 * layout.micro_steps  # two steps
        assert [b.index for b in batches] == [
            [i for i, s in expected[rank] if s == slot] for slot in range(len(batches))
        ]
        assert all(b.info[SLOT_KEY].eq(slot).all() for slot, b in enumerate(batches))
        for old, new in zip(batches, actor_batches(batches, layout), strict=True):
            assert_same_forward(old, new)
    if world == N:  # the released code's layout: rank r holds response r of every prompt
        assert all(
            i % N == r for r, bs in enumerate(chunks(dealt, world)) for b in bs for i in b.index
        )


def test_the_scores_pass_under_the_minibatch_kl_is_cut_longest_first_at_the_deal():
    from drpo_openrlhf.update.layout import Layout, cut_longest_first

    layout = Layout(2, N, PROMPTS, 16, 1)  # 1 x 2 ranks: micro-steps cannot hold groups of 4
    assert cut_longest_first(layout, "minibatch")
    assert not cut_longest_first(layout, "microstep")
    assert not cut_longest_first(Layout(2, N, PROMPTS, 16, 2), "minibatch")  # penalty pass
    dealt = dealt_batches(layout, longest_first=True)
    for batches in chunks(dealt, 2):
        for step in (batches[:8], batches[8:]):
            lengths = [int(b.attention_mask.sum()) for b in step]
            assert lengths == sorted(lengths, reverse=True)
        for old, new in zip(batches, actor_batches(batches, layout), strict=True):
            assert_same_forward(old, new)


def test_a_short_rollouts_untrained_responses_get_batches_of_their_own_when_every_rank_has_some():
    from drpo_openrlhf.update.keys import SLOT_KEY
    from drpo_openrlhf.update.layout import UNTRAINED, Layout

    layout = Layout(2, N, PROMPTS, 16, 2)
    samples = rollout_samples(rollout())[: PROMPTS * N - 8]  # one step and two groups
    per_rank = chunks(dealt_batches(layout, samples=samples), 2)
    for batches in per_rank:
        assert len(batches) == layout.micro_steps + 2  # 4 untrained, in micro-batches of 2
        for batch in batches[-2:]:
            assert batch.info[SLOT_KEY].tolist() == [UNTRAINED] * 2
        for old, new in zip(batches[:-2], actor_batches(batches, layout), strict=True):
            assert_same_forward(old, new)


def test_fewer_untrained_responses_than_ranks_ride_in_their_ranks_last_micro_batch():
    from drpo_openrlhf.update.keys import SLOT_KEY
    from drpo_openrlhf.update.layout import UNTRAINED, Layout

    layout = Layout(4, 2, 8, 8, 1)  # groups of 2: one step of 4 groups, then 1 group left
    data = rollout()
    samples = rollout_samples(data)[:10]
    per_rank = chunks(dealt_batches(layout, samples=samples), 4)
    assert [len(batches) for batches in per_rank] == [2, 2, 2, 2]
    last = [batches[-1].info[SLOT_KEY].tolist() for batches in per_rank]
    assert last == [[1, UNTRAINED], [1, UNTRAINED], [1], [1]]


def test_a_rollout_too_short_for_every_rank_is_refused():
    from drpo_openrlhf.update.layout import Layout

    layout = Layout(4, 2, 8, 8, 1)
    with pytest.raises(ValueError, match="cannot give each of the 4 actor ranks one"):
        dealt_batches(layout, samples=rollout_samples(rollout())[:2])


def maker(flags: list[str], kl_estimate: str = "minibatch"):
    """The DRPO experience maker with only what its own methods read."""
    from drpo_openrlhf.update.experience import GroupTaggingExperienceMaker

    args = openrlhf_args(flags)
    args.drpo = SimpleNamespace(kl_estimate=kl_estimate)
    made = object.__new__(GroupTaggingExperienceMaker)
    made.strategy, made.args = SimpleNamespace(args=args), args
    made.tokenizer = SimpleNamespace(pad_token_id=PAD)
    made.advantage_estimator = args.algo.advantage.estimator
    made.kl_ctl = SimpleNamespace(value=0.0)
    return made


FLAGS = [
    *("--rollout.n_samples_per_prompt", str(N), "--rollout.batch_size", str(PROMPTS)),
    *("--rollout.micro_batch_size", "8", "--train.batch_size", "16"),
    *("--train.micro_batch_size", "2", "--actor.num_gpus_per_node", "2"),
    *("--algo.advantage.estimator", "group_norm"),
]


def test_the_experience_maker_splits_the_rollout_into_the_updates_micro_batches():
    """Not ``--rollout.micro_batch_size`` (8) consecutive responses but the deal's micro-batches
    of 2; the group tags and OpenRLHF's per-group statistics survive the reordering."""
    from drpo_openrlhf.update.keys import GROUP_KEY

    made = maker(FLAGS)
    data = rollout()
    batches = made.split_rollout_samples(rollout_samples(data))
    assert len(batches) == 2 * 8 and {len(b.index) for b in batches} == {2}
    assert sorted(i for b in batches for i in b.index) == list(range(PROMPTS * N))
    for batch in batches:  # make_experience's fields, then OpenRLHF's advantages
        batch.kl = torch.zeros(batch.action_mask.shape)
    made.compute_advantages_and_returns(batches)
    rewards = data["scores"].view(PROMPTS, N)
    for batch in batches:
        index = torch.tensor(batch.index)
        assert torch.equal(batch.info[GROUP_KEY], index // N)
        expected_std = rewards.std(-1)[index // N]
        assert torch.allclose(batch.info["group_reward_std"], expected_std)


def test_under_dynamic_batching_the_experience_maker_splits_as_openrlhf_does():
    made = maker([*FLAGS, "--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", "40"])
    batches = made.split_rollout_samples(rollout_samples(rollout()))
    assert all("drpo_slot" not in b.info for b in batches)
    assert sum(len(b.index) for b in batches) == PROMPTS * N
