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

*One pass*: with ``kl_estimate="microstep"`` and global micro-steps that hold whole groups
(fixed micro-batches of a multiple of ``n``, or under dynamic batching groups packed into
micro-steps by ``pack_group_microsteps``), a micro-step's scalars alone give its
coefficients (``microstep_coefficients``), so each micro-batch is forwarded once, its
scalars gathered, and back-propagated at once: no scores pass, the cost of a PPO update.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from openrlhf.trainer.ppo_utils.experience import make_experience_batch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.utils.seqlen_balancing import (
    get_minimum_num_micro_batch_size,
    get_seqlen_balanced_partitions,
)
from torch import Tensor

from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    loss_coefficients,
    microstep_coefficients,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.learning_signal import signal_diagnostics
from drpo_openrlhf.integration.layout import (
    Layout,
    LayoutError,
    assign_group_steps,
    pack_group_microsteps,
    plan_optimizer_steps,
)

logger = logging.getLogger(__name__)
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


def all_gather_scalars(local: ResponseScalars) -> tuple[ResponseScalars, int]:
    """Every rank's scalars, concatenated in rank order, and where this rank's start.

    Ranks may hold different numbers of responses (dynamic batching): counts are exchanged
    first and the columns padded to the largest count for the collective."""
    columns = torch.stack(
        [
            local.score.detach().double(),
            local.kl_sum.detach().double(),
            local.num_tokens.double(),
            local.correct.double(),
            local.group_id.double(),
            local.microstep.double(),
        ]
    )
    world = dist.get_world_size()
    count = torch.tensor([columns.shape[1]], device=columns.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    padded = F.pad(columns, (0, max(counts) - columns.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    merged = torch.cat([p[:, :c] for p, c in zip(parts, counts, strict=True)], dim=1)
    s, kl, tokens, correct, group, micro = merged
    gathered = ResponseScalars(s, kl, tokens, correct.bool(), group.long(), micro.long())
    return gathered, sum(counts[: dist.get_rank()])


class DRPOActorTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` with DRPO's loss; everything else (vLLM sync, EMA, checkpoints) is
    inherited untouched. Installed by swapping the class of the trainer OpenRLHF builds."""

    drpo: DRPOConfig
    drpo_max_len: int
    drpo_layout: Layout
    drpo_one_pass: bool  # fixed micro-batches of whole groups: see the module docstring

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
            dynamic_batching=args.train.dynamic_batch_enable,
        )
        self.drpo_layout.check()
        self.drpo_one_pass = (
            config.kl_estimate == "microstep" and self.drpo_layout.groups_fit_micro_batches
        )
        if self.drpo_layout.dynamic_batching:
            return
        if self.drpo_layout.micro_steps != self.strategy.accumulated_gradient:
            raise LayoutError(
                f"DeepSpeed accumulates {self.strategy.accumulated_gradient} micro-batches per "
                f"step but the DRPO plan has {self.drpo_layout.micro_steps}"
            )

    def ppo_train(self, kl_ctl: float) -> dict[str, float]:
        items = self.replay_buffer.items
        group_ids = [int(item.info[GROUP_KEY]) for item in items]
        # Only the short last rollout of an episode may leave groups out (OpenRLHF does not
        # align its chunks to groups then); a full rollout that does not fit is an error.
        total = self._all_reduce(len(items), dist.ReduceOp.SUM)
        partial = (
            total < self.drpo_layout.rollout_batch_size * self.drpo_layout.n_samples_per_prompt
        )
        lengths = [int(item.attention_mask.sum()) for item in items]
        if self.drpo_layout.dynamic_batching:
            plan, one_pass = self._plan_dynamic(group_ids, lengths, partial)
        else:
            plan = plan_optimizer_steps(
                group_ids,
                self.drpo_layout.n_samples_per_prompt,
                self.drpo_layout,
                lengths=lengths,
                allow_partial=partial,
                whole_groups_per_micro_batch=self.drpo_one_pass,
            )
            plan = plan[: self._all_reduce(len(plan), dist.ReduceOp.MIN)]
            one_pass = [self.drpo_one_pass] * len(plan)
        planned = sum(len(mb) for step in plan for mb in step)
        dropped = self._all_reduce(len(items) - planned, dist.ReduceOp.SUM)
        if dropped:
            logger.warning(
                "DRPO: the last rollout of the episode is short; %d of its %d responses do not "
                "form whole prompt groups of whole optimizer steps and are not trained on",
                dropped,
                total,
            )
        step_metrics = []
        for k, step in enumerate(plan):
            batches = [make_experience_batch([items[i] for i in mb]) for mb in step]
            step_metrics.append(
                self._drpo_optimizer_step(batches, policy_is_old=k == 0, one_pass=one_pass[k])
            )
        return {**_mean_metrics(step_metrics), "drpo/dropped_responses": float(dropped)}

    def _all_reduce(self, value: int, op) -> int:
        tensor = torch.tensor([value], device=self._device())
        dist.all_reduce(tensor, op=op)
        return int(tensor)

    def _plan_dynamic(
        self, group_ids: list[int], lengths: list[int], partial: bool
    ) -> tuple[list[list[list[int]]], list[bool]]:
        """Dynamic batching: steps of whole groups over all ranks, the same number of
        micro-batches on every rank (ZeRO's collectives need equal forward counts), and
        whether each step runs in one pass.

        With ``kl_estimate="microstep"`` a step's groups are packed into global micro-steps
        under ``--train.max_tokens_per_gpu`` (one pass) when ``pack_group_microsteps`` can;
        otherwise each rank's share is cut into token-balanced micro-batches by OpenRLHF's
        own functions and the step runs a scores pass."""
        layout = self.drpo_layout
        world = dist.get_world_size()
        everyone: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, list(zip(group_ids, lengths, strict=True)))
        step_of = assign_group_steps(
            [g for pairs in everyone for g, _ in pairs],
            layout.n_samples_per_prompt,
            layout.train_batch_size // layout.n_samples_per_prompt,
            allow_partial=partial,
        )
        shares = {g: [0] * world for g in step_of}  # tokens of each group on each rank
        for rank, pairs in enumerate(everyone):
            for g, length in pairs:
                if g in shares:
                    shares[g][rank] += length
        max_tokens = self.args.train.max_tokens_per_gpu
        plan, one_pass = [], []
        for k in range(len(set(step_of.values()))):
            mine = [i for i, g in enumerate(group_ids) if step_of.get(g) == k]
            microsteps = None
            if self.drpo.kl_estimate == "microstep":
                step_shares = {g: shares[g] for g, step in step_of.items() if step == k}
                microsteps = pack_group_microsteps(step_shares, max_tokens)
            if microsteps is not None:
                where = {g: j for j, groups in enumerate(microsteps) for g in groups}
                parts = [
                    [i for i in mine if where[group_ids[i]] == j] for j in range(len(microsteps))
                ]
                plan.append(parts)
                one_pass.append(True)
                continue
            needed = get_minimum_num_micro_batch_size([lengths[i] for i in mine], max_tokens, 1, 1)
            count = self._all_reduce(needed, dist.ReduceOp.MAX)
            if len(mine) < count:
                raise LayoutError(
                    f"optimizer step {k} gives this rank {len(mine)} responses but the ranks "
                    f"need {count} micro-batches: raise --train.max_tokens_per_gpu"
                )
            parts = get_seqlen_balanced_partitions([lengths[i] for i in mine], count, False)
            plan.append([[mine[j] for j in part] for part in parts])
            one_pass.append(False)
        return plan, one_pass

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

    def _two_pass_backward(
        self, batches: list, policy_is_old: bool
    ) -> tuple[ResponseScalars, Tensor, dict[str, Tensor]]:
        """Scores pass over the whole step, coefficients, then one backward per micro-batch."""
        with torch.no_grad():
            local = ResponseScalars.concat(
                [self._scalars(b, j, use_old=policy_is_old) for j, b in enumerate(batches)]
            )
        gathered, offset = all_gather_scalars(local)
        score_coef, kl_coef, metrics = loss_coefficients(gathered, self.drpo, self.drpo_max_len)
        for j, batch in enumerate(batches):
            self._mark_boundary(j, len(batches))
            r = self._scalars(batch, j, use_old=False)
            end = offset + r.score.numel()
            self._accumulate(r, score_coef[offset:end], kl_coef[offset:end], j, len(batches))
            offset = end
        return gathered, score_coef, metrics

    def _one_pass_backward(
        self, batches: list
    ) -> tuple[ResponseScalars, Tensor, dict[str, Tensor]]:
        """Per micro-batch: forward, gather its micro-step's scalars, backward (whole groups)."""
        n = self.drpo_layout.n_samples_per_prompt
        num_groups = self.drpo_layout.train_batch_size // n
        parts = []
        for j, batch in enumerate(batches):
            self._mark_boundary(j, len(batches))
            r = self._scalars(batch, j, use_old=False)
            gathered, offset = all_gather_scalars(r)
            if (gathered.group_id.unique(return_counts=True)[1] != n).any():
                raise LayoutError(f"micro-step {j} does not hold whole prompt groups")
            score_coef, kl_coef = microstep_coefficients(
                gathered, self.drpo, self.drpo_max_len, num_groups, len(batches)
            )
            end = offset + r.score.numel()
            self._accumulate(r, score_coef[offset:end], kl_coef[offset:end], j, len(batches))
            parts.append(gathered)
        gathered = ResponseScalars.concat(parts)
        score_coef, _, metrics = loss_coefficients(gathered, self.drpo, self.drpo_max_len)
        return gathered, score_coef, metrics

    def _mark_boundary(self, j: int, count: int) -> None:
        """Under dynamic batching OpenRLHF runs DeepSpeed with one accumulation step, so every
        backward would be a boundary, and ZeRO-1/2 would keep only the last micro-batch's
        gradient: tell DeepSpeed which micro-batch ends the optimizer step."""
        if self.drpo_layout.dynamic_batching:
            self.actor.model.set_gradient_accumulation_boundary(j == count - 1)

    def _accumulate(
        self, r: ResponseScalars, score_coef: Tensor, kl_coef: Tensor, j: int, count: int
    ) -> None:
        """Back-propagates micro-batch ``j`` of ``count``; steps the optimizer after the last."""
        device = r.score.device
        loss = surrogate_loss(r.score, r.kl_sum, score_coef.to(device), kl_coef.to(device))
        dynamic = self.drpo_layout.dynamic_batching
        # undo DeepSpeed's 1/GAS (GAS is 1 under dynamic batching) and data-parallel mean
        scale = (1 if dynamic else count) * dist.get_world_size()
        self.strategy.backward(loss * scale, self.actor, self.actor_optim)
        if not dynamic or j == count - 1:  # dynamic: only at the boundary _mark_boundary set
            self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
            if self.ema_model:  # as OpenRLHF's training_step: acts at the boundary
                self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")

    def _drpo_optimizer_step(
        self, batches: list, *, policy_is_old: bool, one_pass: bool
    ) -> dict[str, float]:
        start = time.perf_counter()
        device = self._device()
        for batch in batches:
            batch.to_device(device)
        self.actor.train()
        if one_pass:
            gathered, score_coef, metrics = self._one_pass_backward(batches)
        else:
            gathered, score_coef, metrics = self._two_pass_backward(batches, policy_is_old)
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
                "drpo/one_pass": float(one_pass),
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
