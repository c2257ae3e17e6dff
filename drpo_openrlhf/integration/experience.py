"""Driver-side hook: tag each response with its prompt group before OpenRLHF splits batches.

OpenRLHF numbers the responses of a rollout in generation order (``experience.index``), a
prompt's ``n`` responses being consecutive, but drops the index when it splits experiences
into samples for the actors. We store ``index // n`` in ``experience.info``, which survives
into the actors' replay buffers.
"""

from __future__ import annotations

import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from drpo_openrlhf.integration.actor_trainer import GROUP_KEY


class GroupTaggingExperienceMaker(RemoteExperienceMaker):
    def compute_advantages_and_returns(self, experiences):
        n = self.strategy.args.rollout.n_samples_per_prompt
        for experience in experiences:
            experience.info[GROUP_KEY] = torch.tensor(experience.index, dtype=torch.long) // n
        return super().compute_advantages_and_returns(experiences)
