"""DRPO's actor update, replacing the PPO loss of OpenRLHF's ``ActorPPOTrainer``.

The rollout reaches the ranks dealt by ``experience.deal_experiences`` (the cross-rank layout
of ``layout.deal_rollout``): every response carries its optimizer step and micro-batch, every
optimizer step holds whole prompt groups across the ranks. An optimizer step runs:

1. *scores pass*: the per-response scalars (score, KL sum, token count) of the step's
   micro-batches, without a graph. On the first step of a rollout the policy still equals
   pi_old, so the old log-probs OpenRLHF already computed give them for free.
2. the scalars of all ranks are all-gathered (a few floats per response, never log-prob
   tensors) and ``loss_coefficients`` differentiates the true mini-batch objective w.r.t.
   them;
3. *gradient pass*: each micro-batch back-propagates ``surrogate_loss``, scaled to undo
   DeepSpeed's ``1/GAS`` and data-parallel mean. The accumulated gradient is exactly the
   gradient of the paper's objective over the mini-batch.

*Sequence parallelism* (``--ds.ring_attn_size``): the ranks of a ring group hold the same
responses, each forwards a slice of their packed tokens, and OpenRLHF's ``Actor`` all-gathers
the token log-probs, so every ring rank computes the same per-response scalars from the whole
response. The scalars are therefore exchanged over the data-parallel group only (each
response counted once), and the loss scale counts data-parallel ranks, not all ranks:
DeepSpeed averages gradients over every rank, and the gather's backward already sums the ring
ranks' identical loss gradients (``data_parallel_group``, ``_accumulate``).

*Tensor parallelism* (``--ds.tensor_parallel_size``, DeepSpeed AutoTP): the ranks of a TP
group hold the same responses too and, the output layer gathering its vocabulary shards,
compute the same full log-probs; DeepSpeed averages over its data-parallel ranks only (TP
ranks excluded), whose count is again the scale.

*One pass*: with ``kl_estimate="microstep"`` and global micro-steps that hold whole groups
(``n`` divides micro-batch x ranks, or under dynamic batching groups packed into micro-steps
by ``pack_group_microsteps``), a micro-step's scalars alone give its coefficients
(``microstep_coefficients``), so each micro-batch is forwarded once, its scalars gathered,
and back-propagated at once: no scores pass, the cost of a PPO update.

*Penalty pass*: with ``kl_estimate="minibatch"`` and such micro-steps, the score terms'
coefficients are micro-step-local too (``group_score_coefficients``) and are
back-propagated in one pass; the penalty's only depend on the mini-batch KL, known once the
last micro-step is forwarded. Only when it exceeds ``delta`` does a second pass
back-propagate the penalty (``drpo/penalty_pass``: the fraction of steps that needed it).

*The trust region's noise floor*: at identical weights a forward's bf16 rounding depends on
the batch it runs in, so old log-probs computed in other micro-batches than the update's
give a KL estimate off zero, on the first step of a rollout too (docs/algorithm.md). With
fixed micro-batches the driver computes them in exactly the update's micro-batches
(``experience``), which this update forwards as dealt: the log-probs agree bit for bit. Under
dynamic batching the update plans its micro-batches here, after the old log-probs exist; on
the first step of a rollout, where the policy still is pi_old, the update's own forward
gives pi_old's log-probs (``_scalars``), so that only later steps keep the floor.
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
    group_score_coefficients,
    loss_coefficients,
    microstep_coefficients,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.learning_signal import signal_diagnostics
from drpo_openrlhf.algo.rollout_correction import CorrectionScalars, RolloutWeights, rollout_weights
from drpo_openrlhf.rewards.positive_engine import POSITIVE_KEY
from drpo_openrlhf.update.keys import GROUP_KEY, SLOT_KEY, correctness
from drpo_openrlhf.update.layout import (
    ONE_PASS,
    PENALTY_PASS,
    Layout,
    LayoutError,
    fixed_batch_mode,
    layout_from_args,
    plan_dynamic_steps,
    plan_from_slots,
)

logger = logging.getLogger(__name__)


def data_parallel_group(strategy) -> dist.ProcessGroup | None:
    """The ranks that hold different responses: one rank of each ring-attention and
    tensor-parallel group (OpenRLHF's ``dp`` mesh dimension), or ``None``, the default
    group, without either. Collectives that count responses run over it, so that each
    counts once."""
    if strategy.ring_attn_size == 1 and strategy.ds_tensor_parallel_size == 1:
        return None
    return strategy.ds_device_mesh["dp"].get_group()


def all_gather_counts(
    counts: list[int], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[list[int]]:
    """``counts`` (one per micro-step) of every rank of ``group``, ``[micro-step][rank]``: one
    collective per optimizer step, so that each micro-step's scalars need only one."""
    local = torch.tensor(counts, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts, dim=1).tolist()


def all_gather_scalars(
    local: ResponseScalars, counts: list[int], group: dist.ProcessGroup | None = None
) -> tuple[ResponseScalars, int]:
    """Every rank's scalars (of ``group``), concatenated in rank order, and where this rank's
    start.

    Ranks may hold different numbers of responses (dynamic batching), so every rank's count
    is given (``all_gather_counts``) and the columns are padded to the largest one for the
    collective. Every rank carries a positive-reward column or none, and the rollout
    correction's or none (``DRPOConfig``)."""
    preference = [] if local.preference is None else [local.preference.detach().double()]
    correction = [] if local.correction is None else local.correction.columns()
    columns = torch.stack(
        [
            local.score.detach().double(),
            local.kl_sum.detach().double(),
            local.num_tokens.double(),
            local.correct.double(),
            local.group_id.double(),
            local.microstep.double(),
            *preference,
            *correction,
        ]
    )
    padded = F.pad(columns, (0, max(counts) - columns.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded, group=group)
    merged = torch.cat([p[:, :c] for p, c in zip(parts, counts, strict=True)], dim=1)
    s, kl, tokens, correct, prompt, micro, *carried = merged
    preferred = carried.pop(0) if preference else None
    corrected = CorrectionScalars.from_columns(carried) if correction else None
    gathered = ResponseScalars(
        s,
        kl,
        tokens,
        correct.bool(),
        prompt.long(),
        micro.long(),
        preferred,
        correction=corrected,
    )
    return gathered, sum(counts[: dist.get_rank(group)])


class DRPOActorTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` with DRPO's loss; everything else (vLLM sync, EMA, checkpoints) is
    inherited untouched. Installed by swapping the class of the trainer OpenRLHF builds."""

    drpo: DRPOConfig
    drpo_layout: Layout
    drpo_group: dist.ProcessGroup | None
    # this step's forwards give pi_old's log-probs (first step under dynamic batching)
    drpo_forward_is_old: bool = False

    def enable_drpo(self, config: DRPOConfig) -> None:
        args = self.args
        self.drpo = config
        self.drpo_group = data_parallel_group(self.strategy)
        self.drpo_layout = layout_from_args(args, dist.get_world_size(self.drpo_group))
        self.drpo_layout.check()
        if self.drpo_layout.dynamic_batching:
            return
        if self.drpo_layout.micro_steps != self.strategy.accumulated_gradient:
            raise LayoutError(
                f"DeepSpeed accumulates {self.strategy.accumulated_gradient} micro-batches per "
                f"step but the DRPO plan has {self.drpo_layout.micro_steps}"
            )

    @property
    def drpo_mode(self) -> str:
        """How a step of fixed micro-batches runs (``fixed_batch_mode``)."""
        return fixed_batch_mode(self.drpo_layout, self.drpo.kl_estimate)

    def ppo_train(self, kl_ctl: float) -> dict[str, float]:
        items = self.replay_buffer.items
        if self.drpo_layout.dynamic_batching:
            group_ids = [int(item.info[GROUP_KEY]) for item in items]
            lengths = [int(item.attention_mask.sum()) for item in items]
            # Only the short last rollout of an episode may leave groups out; a full rollout
            # that does not fit is an error.
            total = self._all_reduce(len(items), dist.ReduceOp.SUM)
            layout = self.drpo_layout
            partial = total < layout.rollout_batch_size * layout.n_samples_per_prompt
            plan, modes = self._plan_dynamic(group_ids, lengths, partial)
        else:
            plan, modes = self._plan_dealt(items)
        planned = sum(len(mb) for step in plan for mb in step)
        dropped = self._all_reduce(len(items) - planned, dist.ReduceOp.SUM)
        if dropped:
            logger.warning(
                "DRPO: the last rollout of the episode is short; %d of its responses do not "
                "form whole prompt groups of whole optimizer steps and are not trained on",
                dropped,
            )
        step_metrics = []
        for k, step in enumerate(plan):
            batches = [make_experience_batch([items[i] for i in mb]) for mb in step]
            step_metrics.append(
                self._drpo_optimizer_step(batches, policy_is_old=k == 0, mode=modes[k])
            )
        return {**_mean_metrics(step_metrics), "drpo/dropped_responses": float(dropped)}

    def _plan_dealt(self, items: list) -> tuple[list[list[list[int]]], list[str]]:
        """Fixed micro-batches: the plan the driver dealt (``SLOT_KEY``), kept as it is: the
        old log-probs were computed in exactly these micro-batches (``experience``), so
        re-cutting them here would bring back the trust region's noise floor."""
        if any(SLOT_KEY not in item.info for item in items):
            raise LayoutError(
                "the rollout reached this rank without DRPO's slots: it must be dealt by "
                "drpo_openrlhf.update.experience.GroupTaggingExperienceMaker"
            )
        slots = [int(item.info[SLOT_KEY]) for item in items]
        plan = plan_from_slots(slots, self.drpo_layout)
        fewest = self._all_reduce(len(plan), dist.ReduceOp.MIN)
        if fewest != self._all_reduce(len(plan), dist.ReduceOp.MAX):
            raise LayoutError("the actor ranks received different numbers of optimizer steps")
        return plan, [self.drpo_mode] * len(plan)

    def _all_reduce(self, value: int, op) -> int:
        """``value`` reduced over the data-parallel ranks (each response counted once)."""
        tensor = torch.tensor([value], device=self._device())
        dist.all_reduce(tensor, op=op, group=self.drpo_group)
        return int(tensor)

    def _plan_dynamic(
        self, group_ids: list[int], lengths: list[int], partial: bool
    ) -> tuple[list[list[list[int]]], list[str]]:
        """Dynamic batching: every rank's groups and lengths gathered, then the same plan on
        each (``plan_dynamic_steps``), cut with OpenRLHF's own token-balancing functions."""
        everyone: list[list[tuple[int, int]]] = [[] for _ in range(self.drpo_layout.world_size)]
        dist.all_gather_object(
            everyone, list(zip(group_ids, lengths, strict=True)), group=self.drpo_group
        )
        # a ring or tensor-parallel group shares its micro-batch, as in OpenRLHF's budget
        shared = self.strategy.ring_attn_size * self.strategy.ds_tensor_parallel_size
        return plan_dynamic_steps(
            everyone,
            dist.get_rank(self.drpo_group),
            self.drpo_layout,
            max_tokens=self.args.train.max_tokens_per_gpu * shared,
            pack_microsteps=self.drpo.kl_estimate == "microstep",
            allow_partial=partial,
            micro_batches_needed=lambda tokens, budget: get_minimum_num_micro_batch_size(
                tokens, budget, 1, 1
            ),
            balanced_parts=lambda tokens, count: get_seqlen_balanced_partitions(
                tokens, count, False
            ),
        )

    def _device(self) -> torch.device:
        return next(self.actor.model.parameters()).device

    def _scalars(self, batch, microstep: int, *, use_old: bool) -> ResponseScalars:
        """Scalars of one micro-batch; ``use_old`` reads pi_old's log-probs instead of a forward.
        Under ``drpo_forward_is_old`` the forward's log-probs replace pi_old's (they are pi_old's,
        rounded in this micro-batch), so that the step's KL estimate is exactly zero."""
        weights = self._rollout_weights(batch)  # from pi_old as scored: the same in each pass
        if use_old:
            log_probs = batch.action_log_probs
        else:
            log_probs = self.actor(
                batch.sequences,
                batch.action_mask,
                attention_mask=batch.attention_mask,
                ring_attn_group=self.strategy.ring_attn_group,
            )
            if self.drpo_forward_is_old:
                batch.action_log_probs = log_probs.detach()
        group_ids = torch.stack([torch.as_tensor(g) for g in batch.info[GROUP_KEY]])
        return response_scalars(
            log_probs.float(),
            batch.action_log_probs.float(),
            batch.action_mask,
            correctness(batch.scores.to(log_probs.device)),
            group_ids.to(log_probs.device),
            microstep,
            self._preference(batch, log_probs.device),
            weights,
        )

    def _rollout_weights(self, batch) -> RolloutWeights | None:
        """The rollout correction's weights of a micro-batch (``rollout_correction``), or None."""
        correction = self.drpo.rollout_correction
        if not correction.enabled:
            return None
        if batch.rollout_log_probs is None:
            raise ValueError(
                "--algo.advantage.is_correction_level: the rollout reached the actor without "
                "the vLLM engines' log-probs (ray_actors._sampling_params_with_logprobs)"
            )
        return rollout_weights(
            correction, batch.action_log_probs, batch.rollout_log_probs, batch.action_mask
        )

    def _preference(self, batch, device: torch.device) -> Tensor | None:
        """The positive reward each response carries (``positive_engine``), or None when the
        length reward ranks the correct responses (computed from token counts)."""
        if self.drpo.length_positive_reward:
            return None
        if POSITIVE_KEY not in batch.info:
            raise ValueError(
                f"--drpo.positive_reward {self.drpo.positive_reward}: the rollout reached the "
                "actor without its scores (the vLLM engines must be DRPO's: "
                "runtime/ray_actors.py)"
            )
        values = torch.stack([torch.as_tensor(v).flatten()[0] for v in batch.info[POSITIVE_KEY]])
        return values.double().to(device)

    def _microstep_counts(self, batches: list) -> list[list[int]]:
        """Every rank's response count of each micro-step, known before any forward."""
        counts = [len(b.info[GROUP_KEY]) for b in batches]
        return all_gather_counts(counts, self._device(), self.drpo_group)

    def _check_whole(self, gathered: ResponseScalars, where: str) -> None:
        counts = gathered.group_id.unique(return_counts=True)[1]
        if (counts != self.drpo_layout.n_samples_per_prompt).any():
            raise LayoutError(f"{where} does not hold whole prompt groups")

    def _two_pass_backward(
        self, batches: list, policy_is_old: bool
    ) -> tuple[ResponseScalars, Tensor, dict[str, Tensor]]:
        """Scores pass over the whole step, coefficients, then one backward per micro-batch."""
        with torch.no_grad():
            local = ResponseScalars.concat(
                [self._scalars(b, j, use_old=policy_is_old) for j, b in enumerate(batches)]
            )
        counts = all_gather_counts([local.score.numel()], self._device(), self.drpo_group)[0]
        gathered, offset = all_gather_scalars(local, counts, self.drpo_group)
        self._check_whole(gathered, "the optimizer step")
        score_coef, kl_coef, metrics = loss_coefficients(gathered, self.drpo)
        for j, batch in enumerate(batches):
            r = self._scalars(batch, j, use_old=False)
            end = offset + r.score.numel()
            self._accumulate(r, score_coef[offset:end], kl_coef[offset:end], j == len(batches) - 1)
            offset = end
        return gathered, score_coef, metrics

    def _microstep(
        self, batch, j: int, counts: list[int]
    ) -> tuple[ResponseScalars, ResponseScalars, slice]:
        """Micro-step ``j``: this rank's forward, every rank's scalars of it gathered (whole
        groups checked), and where this rank's responses sit among them."""
        r = self._scalars(batch, j, use_old=False)
        gathered, offset = all_gather_scalars(r, counts, self.drpo_group)
        self._check_whole(gathered, f"micro-step {j}")
        return r, gathered, slice(offset, offset + r.score.numel())

    def _one_pass_backward(
        self, batches: list
    ) -> tuple[ResponseScalars, Tensor, dict[str, Tensor]]:
        """Per micro-batch: forward, gather its micro-step's scalars, backward (whole groups)."""
        num_groups = self.drpo_layout.train_batch_size // self.drpo_layout.n_samples_per_prompt
        counts = self._microstep_counts(batches)
        parts = []
        for j, batch in enumerate(batches):
            r, gathered, mine = self._microstep(batch, j, counts[j])
            score_coef, kl_coef = microstep_coefficients(
                gathered, self.drpo, num_groups, len(batches)
            )
            self._accumulate(r, score_coef[mine], kl_coef[mine], j == len(batches) - 1)
            parts.append(gathered)
        gathered = ResponseScalars.concat(parts)
        score_coef, _, metrics = loss_coefficients(gathered, self.drpo)
        return gathered, score_coef, metrics

    def _penalty_pass_backward(
        self, batches: list
    ) -> tuple[ResponseScalars, Tensor, dict[str, Tensor], bool]:
        """Mini-batch KL with whole groups per micro-step: the score terms in one pass; the
        penalty in a second pass only if the mini-batch KL exceeds ``delta``. Returns also
        whether the second pass ran. The last micro-step's backward waits for that decision:
        it ends the optimizer step unless the penalty pass follows."""
        num_groups = self.drpo_layout.train_batch_size // self.drpo_layout.n_samples_per_prompt
        counts = self._microstep_counts(batches)
        parts: list[ResponseScalars] = []
        mine_of: list[slice] = []  # this rank's responses among the whole step's

        def score_backward(r, gathered, mine: slice, last: bool) -> None:
            score_coef = group_score_coefficients(gathered, self.drpo, num_groups)[mine]
            self._accumulate(r, score_coef, torch.zeros_like(score_coef), last)

        def forward(j: int) -> tuple[ResponseScalars, ResponseScalars, slice]:
            r, gathered, mine = self._microstep(batches[j], j, counts[j])
            base = sum(p.score.numel() for p in parts)
            mine_of.append(slice(base + mine.start, base + mine.stop))
            parts.append(gathered)
            return r, gathered, mine

        for j in range(len(batches) - 1):
            score_backward(*forward(j), last=False)
        r, gathered, mine = forward(len(batches) - 1)
        everyone = ResponseScalars.concat(parts)
        score_all, kl_coef, metrics = loss_coefficients(everyone, self.drpo)
        penalty = bool((kl_coef != 0).any())
        score_backward(r, gathered, mine, last=not penalty)
        if penalty:
            for j, batch in enumerate(batches):
                r = self._scalars(batch, j, use_old=False)
                kl = kl_coef[mine_of[j]]
                self._accumulate(r, torch.zeros_like(kl), kl, j == len(batches) - 1)
        return everyone, score_all, metrics, penalty

    def _accumulate(
        self, r: ResponseScalars, score_coef: Tensor, kl_coef: Tensor, last: bool
    ) -> None:
        """Back-propagates one micro-batch; steps the optimizer after the step's ``last``.

        The boundary is always marked by hand (a penalty pass makes more backwards than
        DeepSpeed's accumulation steps; under dynamic batching OpenRLHF runs DeepSpeed with
        one accumulation step, and ZeRO-1/2 would keep only the last micro-batch's gradient
        otherwise), and the optimizer is stepped once."""
        device = r.score.device
        engine = self.actor.model
        engine.set_gradient_accumulation_boundary(last)
        loss = surrogate_loss(r.gradient_score, r.kl_sum, score_coef.to(device), kl_coef.to(device))
        # undo DeepSpeed's 1/GAS and its mean over data-parallel ranks. Under ring attention
        # DeepSpeed averages over the ring ranks too, but the ranks of a ring group
        # back-propagate the same loss, which the log-prob gather's backward sums over the
        # group; under AutoTP it leaves the tensor-parallel ranks out of its mean
        scale = engine.gradient_accumulation_steps() * dist.get_world_size(self.drpo_group)
        self.strategy.backward(loss * scale, self.actor, self.actor_optim)
        if last:
            skipped = engine.skipped_steps
            self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
            check_finite_update(
                self.strategy.get_grad_norm(self.actor),
                engine.skipped_steps > skipped,
                finite_weights(engine.module),
            )
            # OpenRLHF's training_step calls moving_average once per micro-batch and it acts
            # on every accumulated_gradient-th call (every call under dynamic batching);
            # call it that often per optimizer step, so that it acts once, here
            calls = 1 if self.drpo_layout.dynamic_batching else self.strategy.accumulated_gradient
            for _ in range(calls if self.ema_model else 0):
                self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")

    def _drpo_optimizer_step(
        self, batches: list, *, policy_is_old: bool, mode: str
    ) -> dict[str, float]:
        start = time.perf_counter()
        device = self._device()
        for batch in batches:
            batch.to_device(device)
        self.actor.train()
        self.drpo_forward_is_old = policy_is_old and self.drpo_layout.dynamic_batching
        penalty = False
        if mode == ONE_PASS:
            gathered, score_coef, metrics = self._one_pass_backward(batches)
        elif mode == PENALTY_PASS:
            gathered, score_coef, metrics, penalty = self._penalty_pass_backward(batches)
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
                "drpo/one_pass": float(mode == ONE_PASS or (mode == PENALTY_PASS and not penalty)),
                "drpo/penalty_pass": float(penalty),
                "actor_lr": self.actor_scheduler.get_last_lr()[0],
                "actor_grad_norm": float(self.strategy.get_grad_norm(self.actor)),
            }
        )
        return out


class NonFiniteUpdateError(FloatingPointError):
    """An optimizer step whose gradient is NaN or infinite."""


def check_finite_update(
    grad_norm: float | Tensor | None, skipped: bool = False, weights_finite: bool = True
) -> None:
    """Stop the run after an optimizer step with a NaN or infinite gradient (a NaN loss makes
    one), before the step's weights are sent to vLLM or saved: the last checkpoint holds the
    last finite weights. In bf16, DeepSpeed's ZeRO-0/1/2 skip such a step silently, leaving
    the last norm in place (``skipped``: ``skipped_steps`` grew). In fp32 (the CPU path of a
    CPU without native bf16) every stage, and ZeRO-3 in bf16, apply it and report a finite
    norm (1.0: the norm of DeepSpeed's -1 mark for a NaN), so only the weights tell
    (``weights_finite``, ``finite_weights``; measured in tests/test_fault_handling.py). All
    are the same on every rank, so all ranks stop together. ``grad_norm`` None: no norm
    computed."""
    norm = None if grad_norm is None else float(grad_norm)
    if skipped:
        what = "skipped by DeepSpeed"
    elif not weights_finite:
        what = "applied by DeepSpeed: the weights it left hold NaN or inf"
    elif norm is not None and not math.isfinite(norm):
        what = f"of norm {norm}"
    else:
        return
    raise NonFiniteUpdateError(
        f"an optimizer step's gradient is not finite ({what}: a NaN or infinite loss, "
        "reward or activation): stopping before these weights are used or saved"
    )


def finite_weights(module: torch.nn.Module) -> bool:
    """Whether every actor rank holds only finite weights after a step: each checks what it
    holds (its ZeRO-3 partition, else the whole parameter), one flag all-reduced. A pass over
    the rank's own weights, a small share of the optimizer step's own memory traffic."""
    device = next(module.parameters()).device
    bad = torch.zeros((), device=device)
    for param in module.parameters():  # on the device: one host sync, after the reduction
        held = getattr(param, "ds_tensor", param.data)
        bad = torch.maximum(bad, (~torch.isfinite(held)).any().to(bad.dtype))
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


class FiniteCheckedPPOTrainer(ActorPPOTrainer):
    """OpenRLHF's PPO update (the baselines) with ``check_finite_update`` after each step."""

    def training_step(self, *args, **kwargs):
        skipped = self.actor.model.skipped_steps
        status = super().training_step(*args, **kwargs)
        grew = self.actor.model.skipped_steps > skipped
        weights = finite_weights(self.actor.model.module)
        check_finite_update(status["metrics"].get("actor_grad_norm"), grew, weights)
        return status


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
