"""Driver-side hooks: tag each response with its prompt group, and deal the rollout to the
actor ranks in the cross-rank layout.

OpenRLHF numbers the responses of a rollout in generation order (``experience.index``), a
prompt's ``n`` responses being consecutive, but drops the index when it splits experiences
into samples for the actors. We store ``index // n`` in ``experience.info``, which survives
into the actors' replay buffers.

OpenRLHF's ``PPOTrainer.train_step`` then hands rank ``r`` the ``r``-th contiguous chunk of
the list of experience batches the experience maker returns. We return that list rebuilt so
that the chunks are the ranks' shares under ``deal_rollout`` (every global micro-step holds
whole groups where the batch arithmetic allows), with each response's slot (optimizer step
and micro-batch) in ``experience.info``, so the actors need no other knowledge of it. Under
dynamic batching OpenRLHF re-deals the rollout by length (``balance_experiences``) and the
actor plans from its group ids alone; nothing is dealt here then.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from drpo_openrlhf.integration.actor_trainer import GROUP_KEY, SLOT_KEY
from drpo_openrlhf.integration.layout import Layout, data_parallel_size, deal_rollout
from drpo_openrlhf.integration.reward_guard import check_rollout_rewards


def layout_of(args, world_size: int) -> Layout:
    """The batch arithmetic of OpenRLHF's nested ``args`` on ``world_size`` actor ranks."""
    return Layout(
        world_size=world_size,
        n_samples_per_prompt=args.rollout.n_samples_per_prompt,
        rollout_batch_size=args.rollout.batch_size,
        train_batch_size=args.train.batch_size,
        micro_batch_size=args.train.micro_batch_size,
        dynamic_batching=args.train.dynamic_batch_enable,
    )


def _stacked_info(batch):
    """``make_experience_batch`` leaves per-sample tensors in ``info`` as lists; OpenRLHF's
    driver code (``_compute_rollout_stats``) concatenates them as tensors."""
    batch.info = {
        k: torch.stack(v) if isinstance(v, list) and v and torch.is_tensor(v[0]) else v
        for k, v in batch.info.items()
    }
    return batch


def deal_experiences(experiences: list, layout: Layout) -> list:
    """The rollout as ``world_size x b`` experience batches, rank ``r``'s share being batches
    ``r*b .. r*b+b-1`` (OpenRLHF's contiguous chunks), each response tagged with its slot.

    ``b`` keeps about the rollout's own batch size. A short last rollout of an episode deals
    what forms whole optimizer steps and marks the rest ``UNTRAINED``."""
    items = [item for batch in experiences for item in split_experience_batch(batch)]
    group_ids = [int(item.info[GROUP_KEY]) for item in items]
    partial = len(items) < layout.rollout_batch_size * layout.n_samples_per_prompt
    ranks = deal_rollout(group_ids, layout, allow_partial=partial)
    for pairs in ranks:
        for i, slot in pairs:
            items[i].info[SLOT_KEY] = torch.tensor(slot)
    per_rank = max(1, min(len(experiences) // layout.world_size, *map(len, ranks)))
    dealt = []
    for pairs in ranks:
        share = [items[i] for i, _ in pairs]
        if not share:
            raise ValueError(
                f"the rollout's {len(items)} responses cannot give each of the "
                f"{layout.world_size} actor ranks one"
            )
        bounds = [len(share) * b // per_rank for b in range(per_rank + 1)]
        dealt += [_stacked_info(make_experience_batch(share[lo:hi])) for lo, hi in pairwise(bounds)]
    return dealt


class GroupTaggingExperienceMaker(RemoteExperienceMaker):
    def compute_advantages_and_returns(self, experiences):
        n = self.strategy.args.rollout.n_samples_per_prompt
        for experience in experiences:
            experience.info[GROUP_KEY] = torch.tensor(experience.index, dtype=torch.long) // n
        return super().compute_advantages_and_returns(experiences)

    def make_experience_batch(self, rollout_samples):
        check_rollout_rewards(rollout_samples)
        experiences = super().make_experience_batch(rollout_samples)
        args = self.strategy.args
        if args.train.dynamic_batch_enable:
            return experiences
        gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
        world = data_parallel_size(gpus, args.ds.ring_attn_size, args.ds.tensor_parallel_size)
        return deal_experiences(experiences, layout_of(args, world))
