"""The driver-side dealer hands OpenRLHF's contiguous chunks out as the cross-rank layout."""

import torch
from actor_setup import experience
from drpo_actor_harness import PROMPTS, N, rollout


def test_each_ranks_chunk_is_its_dealt_share_with_slots_and_stacked_info():
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    from drpo_openrlhf.integration.actor_trainer import GROUP_KEY, SLOT_KEY
    from drpo_openrlhf.integration.experience import deal_experiences
    from drpo_openrlhf.integration.layout import Layout, deal_rollout

    data = rollout()
    b = PROMPTS * N
    info = {GROUP_KEY: data["group"], "reward": data["scores"]}
    batches = [  # OpenRLHF's rollout micro-batches of 4, in generation order
        experience(
            {k: v[i : i + 4] for k, v in data.items()},
            torch.zeros(4, 1),
            {k: v[i : i + 4] for k, v in info.items()},
        )
        for i in range(0, b, 4)
    ]
    layout = Layout(4, N, PROMPTS, 16, 1)  # 4 ranks = n: rank r holds response r
    dealt = deal_experiences(batches, layout)
    assert len(dealt) % 4 == 0
    per_rank = len(dealt) // 4  # OpenRLHF's chunk size: rank r gets batches r*b .. r*b+b-1
    expected = deal_rollout(data["group"].tolist(), layout)
    for rank in range(4):
        items = [
            it
            for batch in dealt[rank * per_rank : (rank + 1) * per_rank]
            for it in split_experience_batch(batch)
        ]
        positions = [i for i, _ in expected[rank]]
        assert [int(it.info[SLOT_KEY]) for it in items] == [s for _, s in expected[rank]]
        assert [int(it.info[GROUP_KEY]) for it in items] == [i // N for i in positions]
        assert all(i % N == rank for i in positions)
        lengths = [int(it.attention_mask.sum()) for it in items]
        assert lengths == data["attention_mask"][positions].sum(-1).tolist()
    rewards = torch.cat([batch.info["reward"] for batch in dealt])  # as _compute_rollout_stats
    assert rewards.shape == (b,) and rewards.sum() == data["scores"].sum()
