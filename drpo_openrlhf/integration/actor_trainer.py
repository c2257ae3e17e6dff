"""DRPO's actor update, replacing the PPO loss of OpenRLHF's ``ActorPPOTrainer``.

Each optimizer step takes whole prompt groups (``layout.plan_optimizer_steps``) and runs:

1. *scores pass*: the per-response scalars (score, KL sum, token count) of the step's
   micro-batches, without a graph. On the first step of a rollout the policy still equals
   pi_old, so the old log-probs OpenRLHF already computed give them for free.
2. the scalars of all ranks are all-gathered (a few floats per response, never log-prob
   tensors) and ``loss_coefficients`` differentiates the true mini-batch objective w.r.t.
   them;
3. *gradient pass*: each micro-batch back-propagates ``surrogate_loss``, scaled to undo
   DeepSpeed's ``1/GAS`` and data-parallel mean. The accumulated gradient is exactly the
   gradient of the paper's objective over the mini-batch.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from torch import Tensor

from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    loss_coefficients,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.learning_signal import signal_diagnostics
from drpo_openrlhf.integration.layout import Layout, LayoutError, plan_optimizer_steps

GROUP_KEY = "drpo_group"  # experience.info key carrying each response's prompt-group id


def correctness(scores: Tensor) -> Tensor:
    """The reward function's ``scores`` as booleans; anything but 0/1 is a configuration error."""
    bad = ~((scores == 0) | (scores == 1))
    if bad.any():
        value = scores[bad][0].item()
        raise ValueError(
            f"DRPO needs 0/1 correctness in the reward function's 'scores', got {value}; "
            "use a verifier reward (e.g. drpo_openrlhf/rewards/math_reward.py)"
        )
    return scores == 1


def all_gather_scalars(local: ResponseScalars) -> ResponseScalars:
    """Concatenate every rank's scalars in rank order (equal counts on all ranks)."""
    columns = torch.stack(
        [
            local.score.double(),
            local.kl_sum.double(),
            local.num_tokens.double(),
            local.correct.double(),
            local.group_id.double(),
            local.microstep.double(),
        ]
    )
    parts = [torch.empty_like(columns) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, columns)
    s, kl, tokens, correct, group, micro = torch.cat(parts, dim=1)
    return ResponseScalars(s, kl, tokens, correct.bool(), group.long(), micro.long())


class DRPOActorTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` with DRPO's loss; everything else (vLLM sync, EMA, checkpoints) is
    inherited untouched. Installed by swapping the class of the trainer OpenRLHF builds."""

    drpo: DRPOConfig
    drpo_max_len: int
    drpo_layout: Layout

    def enable_drpo(self, config: DRPOConfig) -> None:
        args = self.args
        self.drpo = config
        self.drpo_max_len = args.rollout.max_new_tokens
        self.drpo_layout = Layout(
            world_size=dist.get_world_size(),
            n_samples_per_prompt=args.rollout.n_samples_per_prompt,
            rollout_batch_size=args.rollout.batch_size,
            train_batch_size=args.train.batch_size,
            micro_batch_size=self.micro_train_batch_size,
            rollout_micro_batch_size=args.rollout.micro_batch_size,
        )
        self.drpo_layout.check()
        if self.drpo_layout.micro_steps != self.strategy.accumulated_gradient:
            raise LayoutError(
                f"DeepSpeed accumulates {self.strategy.accumulated_gradient} micro-batches per "
                f"step but the DRPO plan has {self.drpo_layout.micro_steps}"
            )

    def ppo_train(self, kl_ctl: float) -> dict[str, float]:
        items = self.replay_buffer.items
        group_ids = [int(item.info[GROUP_KEY]) for item in items]
        plan = plan_optimizer_steps(
            group_ids, self.drpo_layout.n_samples_per_prompt, self.drpo_layout
        )
        step_metrics = []
        for k, step in enumerate(plan):
            batches = [self.replay_buffer.collate_fn([items[i] for i in mb]) for mb in step]
            step_metrics.append(self._drpo_optimizer_step(batches, policy_is_old=k == 0))
        return _mean_metrics(step_metrics)

    def _device(self) -> torch.device:
        return next(self.actor.model.parameters()).device

    def _scalars(self, batch, microstep: int, *, use_old: bool) -> ResponseScalars:
        """Scalars of one micro-batch; ``use_old`` reads pi_old's log-probs instead of a forward."""
        if use_old:
            log_probs = batch.action_log_probs
        else:
            log_probs = self.actor(
                batch.sequences,
                batch.action_mask,
                attention_mask=batch.attention_mask,
                ring_attn_group=self.strategy.ring_attn_group,
            )
        group_ids = torch.stack([torch.as_tensor(g) for g in batch.info[GROUP_KEY]])
        return response_scalars(
            log_probs.float(),
            batch.action_log_probs.float(),
            batch.action_mask,
            correctness(batch.scores.to(log_probs.device)),
            group_ids.to(log_probs.device),
            microstep,
        )

    def _drpo_optimizer_step(self, batches: list, *, policy_is_old: bool) -> dict[str, float]:
        start = time.perf_counter()
        device = self._device()
        for batch in batches:
            batch.to_device(device)
        self.actor.train()
        with torch.no_grad():
            local = ResponseScalars.concat(
                [self._scalars(b, j, use_old=policy_is_old) for j, b in enumerate(batches)]
            )
        gathered = all_gather_scalars(local)
        score_coef, kl_coef, metrics = loss_coefficients(gathered, self.drpo, self.drpo_max_len)
        world, rank = dist.get_world_size(), dist.get_rank()
        offset = rank * local.score.numel()
        scale = len(batches) * world  # undo DeepSpeed's 1/GAS and the data-parallel mean
        for j, batch in enumerate(batches):
            r = self._scalars(batch, j, use_old=False)
            end = offset + r.score.numel()
            loss = surrogate_loss(
                r.score, r.kl_sum, score_coef[offset:end].to(device), kl_coef[offset:end].to(device)
            )
            self.strategy.backward(loss * scale, self.actor, self.actor_optim)
            self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
            offset = end
        elapsed = time.perf_counter() - start

        signal = signal_diagnostics((-score_coef).tolist(), gathered.correct.tolist())
        truncated = torch.cat([b.truncated.float().flatten() for b in batches])
        out = {f"drpo/{k}": float(v) for k, v in metrics.items()}
        out.update(
            {
                "policy_loss": float(metrics["loss"]),
                "drpo/frac_correct_negative_signal": signal["frac_correct_negative"],
                "drpo/mean_signal_correct": signal["mean_signal_correct"],
                "drpo/mean_signal_incorrect": signal["mean_signal_incorrect"],
                "drpo/truncated": truncated.mean().item(),
                "drpo/update_tokens_per_s": float(gathered.num_tokens.sum()) / elapsed,
                "actor_lr": self.actor_scheduler.get_last_lr()[0],
                "actor_grad_norm": float(self.strategy.get_grad_norm(self.actor)),
            }
        )
        return out


def _mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Mean over optimizer steps, ignoring NaN (e.g. no incorrect response in a step)."""
    if not steps:
        return {}
    means = {}
    for key in steps[0]:
        values = [s[key] for s in steps if not math.isnan(s[key])]
        means[key] = sum(values) / len(values) if values else math.nan
    means["actor_lr"] = steps[-1]["actor_lr"]
    means["actor_grad_norm"] = steps[-1]["actor_grad_norm"]
    return means
