"""Driver-side hooks: tag each response with its prompt group, and deal the rollout to the
actor ranks in the cross-rank layout, in the update's own micro-batches.

OpenRLHF numbers the responses of a rollout in generation order (``experience.index``), a
prompt's ``n`` responses being consecutive, but drops the index when it splits experiences
into samples for the actors. We store ``index // n`` in ``experience.info``, which survives
into the actors' replay buffers.

OpenRLHF cuts the rollout into experience batches (``split_rollout_samples``), computes the
old log-probs (pi_old) one batch per forward, rank ``r`` forwarding the ``r``-th contiguous
chunk of the list, and hands rank ``r`` that same chunk for its update
(``async_run_method_batch``). Its batches are ``--rollout.micro_batch_size`` consecutive
responses; the update forwards the same responses in its own micro-batches (another size,
whole prompt groups per step, other padding). In bf16 a forward's rounding depends on the
batch it runs in, so at identical weights the two disagree, and the trust region's KL
estimate is off zero on rounding alone, at times above ``delta`` (docs/algorithm.md,
the noise floor). So the rollout is dealt *before* the old log-probs: ``split_rollout_samples``
returns exactly the update's micro-batches under ``deal_rollout`` (each response's optimizer
step and micro-batch in ``experience.info``), rank ``r``'s contiguous, in slot order, and the
actor forwards each of them as it is (``actor_trainer._plan_dealt``): the same rows in the same
order, padded to the same width, through the same ``Actor``, so the old log-probs and the first
step's forward are bit-identical, at no extra forward. That beats taking the first step's
forward as pi_old (the fallback under dynamic batching, below), which would fix that step
only: here every later step too compares log-probs rounded in the batch it forwards, so its
estimate holds the weights' change and no layout noise. The cost is that pi_old is scored
``--train.micro_batch_size`` responses at a time; ``--rollout.micro_batch_size`` no longer
applies to DRPO. The scores pass under the mini-batch KL, whose update does not depend on the
cut, has its micro-batches cut longest first here, at the deal (``cut_longest_first``).

Not covered: the short last rollout of an episode, whose responses beyond the last whole
optimizer step are not trained on, when there are fewer of them than ranks: they ride in
their rank's last micro-batch, whose old log-probs then come from a batch one row longer.
Under dynamic batching OpenRLHF cuts the rollout by token budget and re-deals it by length
(``balance_experiences``) and the actor plans its micro-batches from its group ids alone;
nothing is dealt here then, and the actor uses its first step's forward as pi_old instead
(``actor_trainer``). Ring attention and tensor parallelism change nothing: the ranks of a
ring or TP group receive the same chunk, forward the same micro-batch together both times.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from drpo_openrlhf.rewards.reward_guard import check_rollout_rewards
from drpo_openrlhf.update.keys import GROUP_KEY, SLOT_KEY
from drpo_openrlhf.update.layout import (
    UNTRAINED,
    Layout,
    cut_longest_first,
    deal_rollout,
    layout_from_args,
)


def deal_samples(samples: list, layout: Layout, pad_token_id: int, longest_first: bool) -> list:
    """The rollout's single-response ``samples`` (generation order) as the update's
    micro-batches: ``world_size x b`` experience batches, rank ``r``'s being batches
    ``r*b .. r*b+b-1`` (OpenRLHF's contiguous chunks), each response tagged with its slot.

    A short last rollout of an episode deals what forms whole optimizer steps and marks the
    rest ``UNTRAINED``: in micro-batches of their own when every rank has some (as many per
    rank), else in their rank's last micro-batch (one each at most: they are dealt
    round-robin)."""
    n = layout.n_samples_per_prompt
    group_ids = [i // n for i in range(len(samples))]
    partial = len(samples) < layout.rollout_batch_size * n
    lengths = [int(s.attention_mask.sum()) for s in samples] if longest_first else None
    ranks = deal_rollout(group_ids, layout, allow_partial=partial, lengths=lengths)
    shares, rest = [], []
    for pairs in ranks:
        slots: dict[int, list[int]] = {}
        for i, slot in pairs:
            samples[i].info[SLOT_KEY] = torch.tensor([slot])
            if slot != UNTRAINED:
                slots.setdefault(slot, []).append(i)
        shares.append(list(slots.values()))
        rest.append([i for i, slot in pairs if slot == UNTRAINED])
    fewest = min(map(len, rest))
    for share, left in zip(shares, rest, strict=True):
        if fewest:
            count = -(-fewest // layout.micro_batch_size)
            bounds = [len(left) * b // count for b in range(count + 1)]
            share += [left[lo:hi] for lo, hi in pairwise(bounds)]
        elif left and share:
            share[-1] = share[-1] + left
        elif left or not share:
            raise ValueError(
                f"the rollout's {len(samples)} responses cannot give each of the "
                f"{layout.world_size} actor ranks one"
            )
    return [
        Experience.concat_experiences([samples[i] for i in batch], pad_token_id)
        for share in shares
        for batch in share
    ]


class GroupTaggingExperienceMaker(RemoteExperienceMaker):
    def split_rollout_samples(self, rollout_samples):
        args = self.strategy.args
        if args.train.dynamic_batch_enable:
            return super().split_rollout_samples(rollout_samples)
        for i, sample in enumerate(rollout_samples):
            sample.index = [i]  # as OpenRLHF's own split does
        layout = layout_from_args(args)
        longest_first = cut_longest_first(layout, args.drpo.kl_estimate)
        return deal_samples(rollout_samples, layout, self.tokenizer.pad_token_id, longest_first)

    def compute_advantages_and_returns(self, experiences):
        n = self.strategy.args.rollout.n_samples_per_prompt
        for experience in experiences:
            experience.info[GROUP_KEY] = torch.tensor(experience.index, dtype=torch.long) // n
        return super().compute_advantages_and_returns(experiences)

    def make_experience_batch(self, rollout_samples):
        check_rollout_rewards(rollout_samples)
        return super().make_experience_batch(rollout_samples)
