"""Single-process RL training (CPU or one GPU): DRPO, or a length-shaped GRPO/RLOO baseline.

Same loop as the OpenRLHF path, with every algorithmic piece taken from the shared core:

1. sample ``n`` responses for each of ``rollout_batch_size`` prompts (``rollout.py``) and
   grade them with the reward function (0/1 correctness, ``grade_responses`` by default);
2. compute pi_old's token log-probs once;
3. ``plan_optimizer_steps`` cuts the rollout into optimizer steps of whole prompt groups and
   micro-batches, exactly as the DRPO actor does on each rank;
4. DRPO: per step, the scalars of all micro-batches go through ``loss_coefficients`` (the
   true mini-batch objective) and each micro-batch back-propagates ``surrogate_loss``;
   baselines: ``GroupRewardShaper`` + ``group_advantages``, then the clipped policy-gradient
   loss with per-response length normalisation (the paper's RLOO-LP/HAPO recipe).

The checkpoint is a ``save_pretrained`` directory (``drpo-eval`` reads it as is) plus
``local_train.json`` with the method's settings and the step. ``resume/`` beside it holds
what continuing needs (weights, optimizer and shaper state, step), replaced atomically every
``save_steps`` rollouts and at the end, so an interrupted run loses at most ``save_steps``
rollouts: run the same command with ``resume=True`` (``--resume``).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    loss_coefficients,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.advantages import group_advantages
from drpo_openrlhf.algo.learning_signal import signal_diagnostics
from drpo_openrlhf.algo.shaper import GroupRewardShaper
from drpo_openrlhf.eval.problems import Problem
from drpo_openrlhf.eval.runner import Grader, encode_prompt, load_grader
from drpo_openrlhf.integration.layout import Layout, plan_optimizer_steps
from drpo_openrlhf.local.rollout import Rollout, generate_rollout, token_log_probs

CHECKPOINT_FILE = "local_train.json"
CHECKPOINT_FORMAT = 1
RESUME_DIR = "resume"
OPTIMIZER_FILE = "optimizer.pt"
DRPO = "drpo"


@dataclass(frozen=True)
class TrainConfig:
    """Batch arithmetic, sampling and optimiser of a run (OpenRLHF's flag names in comments).

    ``method`` is ``"drpo"`` or a baseline of ``algo.shaping.METHODS`` with ``shaping_params``.
    """

    method: str = DRPO
    shaping_params: dict[str, float | None] = field(default_factory=dict)
    rollout_steps: int = 40
    rollout_batch_size: int = 16  # --rollout.batch_size (prompts)
    n_samples_per_prompt: int = 8  # --rollout.n_samples_per_prompt
    train_batch_size: int = 64  # --train.batch_size (responses per optimizer step)
    micro_batch_size: int = 64  # --train.micro_batch_size
    max_new_tokens: int = 128  # --rollout.max_new_tokens
    temperature: float = 0.6  # the authors' (and drpo_openrlhf.train's) rollout temperature
    top_p: float = 1.0
    lr: float = 2e-4  # for models of ~1M parameters; the paper's 1.5B runs use 2e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eps_clip: float = 0.2  # baselines only
    seed: int = 0

    def layout(self) -> Layout:
        layout = Layout(
            world_size=1,
            n_samples_per_prompt=self.n_samples_per_prompt,
            rollout_batch_size=self.rollout_batch_size,
            train_batch_size=self.train_batch_size,
            micro_batch_size=self.micro_batch_size,
        )
        layout.check()
        return layout

    def estimator(self) -> str:
        """The paper's advantage estimator of a baseline: RLOO for RLOO-LP, GRPO otherwise."""
        return "rloo" if self.method == "rloo_lp" else "grpo"


def correctness_of(
    grader: Grader, texts: Sequence[str], labels: Sequence[str], device: torch.device
) -> Tensor:
    return torch.tensor([bool(o.correct) for o in grader(texts, labels)], device=device)


def _micro_batch_scalars(
    log_probs: Tensor, old_log_probs: Tensor, part: Rollout, correct: Tensor, microstep: int
) -> ResponseScalars:
    return response_scalars(
        log_probs, old_log_probs, part.response_mask, correct, part.group_ids, microstep
    )


def drpo_backward(
    model,
    rollout: Rollout,
    old_log_probs: Tensor,
    correct: Tensor,
    micro_batches: Sequence[Sequence[int]],
    config: DRPOConfig,
    train: TrainConfig,
    *,
    policy_is_old: bool,
) -> dict[str, float]:
    """Accumulates the gradient of one optimizer step's DRPO objective, exactly.

    As the OpenRLHF actor does: a no-graph pass gives every response's scalars (pi_old's
    log-probs serve when the policy has not moved yet), ``loss_coefficients`` differentiates
    the whole mini-batch objective with respect to them, and each micro-batch
    back-propagates its ``surrogate_loss``.
    """
    rows = [torch.as_tensor(list(mb), dtype=torch.long) for mb in micro_batches]
    parts = [rollout.select(r.tolist()) for r in rows]
    with torch.no_grad():
        gathered = ResponseScalars.concat(
            [
                _micro_batch_scalars(
                    old_log_probs[r]
                    if policy_is_old
                    else token_log_probs(model, part, train.temperature),
                    old_log_probs[r],
                    part,
                    correct[r],
                    j,
                )
                for j, (r, part) in enumerate(zip(rows, parts, strict=True))
            ]
        )
    score_coef, kl_coef, metrics = loss_coefficients(gathered, config, train.max_new_tokens)
    offset = 0
    for j, (r, part) in enumerate(zip(rows, parts, strict=True)):
        log_probs = token_log_probs(model, part, train.temperature)
        scalars = _micro_batch_scalars(log_probs, old_log_probs[r], part, correct[r], j)
        end = offset + len(r)
        surrogate_loss(
            scalars.score, scalars.kl_sum, score_coef[offset:end], kl_coef[offset:end]
        ).backward()
        offset = end
    signal = signal_diagnostics((-score_coef).tolist(), gathered.correct.tolist())
    out = {f"drpo/{k}": float(v) for k, v in metrics.items()}
    out["frac_correct_negative_signal"] = signal["frac_correct_negative"]
    return out


def policy_gradient_backward(
    model,
    rollout: Rollout,
    old_log_probs: Tensor,
    advantages: Tensor,
    micro_batches: Sequence[Sequence[int]],
    train: TrainConfig,
) -> dict[str, float]:
    """Accumulates the gradient of the baselines' clipped policy-gradient loss.

    Per response, the token mean of ``min(ratio A, clip(ratio) A)`` (the paper's GRPO
    formula, "normalised by the length of the response"), then the mean over the optimizer
    step's responses, so the gradient does not depend on the micro-batch size.
    """
    total = sum(len(mb) for mb in micro_batches)
    clipped = 0.0
    for mb in micro_batches:
        rows = torch.as_tensor(list(mb), dtype=torch.long)
        part = rollout.select(mb)
        mask = part.response_mask.to(old_log_probs.dtype)
        ratio = torch.exp(token_log_probs(model, part, train.temperature) - old_log_probs[rows])
        adv = advantages[rows].to(ratio.dtype)[:, None]
        objective = torch.minimum(
            ratio * adv, ratio.clamp(1 - train.eps_clip, 1 + train.eps_clip) * adv
        )
        per_response = (objective * mask).sum(-1) / mask.sum(-1)
        (-per_response.sum() / total).backward()
        with torch.no_grad():
            outside = ((ratio - 1).abs() > train.eps_clip).to(mask.dtype)
            clipped += float(((outside * mask).sum(-1) / mask.sum(-1)).sum()) / total
    return {"clip_fraction": clipped}


def baseline_advantages(
    shaper: GroupRewardShaper,
    prompts: Sequence[str],
    rollout: Rollout,
    correct: Tensor,
    estimator: str,
) -> tuple[Tensor, list[float]]:
    """Shaped rewards of the rollout's groups, then each group's advantages."""
    n = shaper.n_samples_per_prompt
    keys = [prompts[g] for g in rollout.group_ids.tolist()]
    rewards = shaper.shape(keys, rollout.num_tokens.tolist(), correct.tolist())
    advantages = [
        a
        for start in range(0, len(rewards), n)
        for a in group_advantages(rewards[start : start + n], estimator)
    ]
    return torch.tensor(advantages, device=rollout.group_ids.device), rewards


def save_checkpoint(
    model,
    tokenizer,
    output_dir: Path,
    train: TrainConfig,
    drpo: DRPOConfig | None,
    shaper: GroupRewardShaper | None,
    step: int,
    init_model: str,
) -> Path:
    """HF model directory plus the run's settings; readable by ``drpo-eval`` as is."""
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    state = {
        "format": CHECKPOINT_FORMAT,
        "method": train.method,
        "step": step,
        "init_model": init_model,
        "train": asdict(train),
        "drpo": None if drpo is None else asdict(drpo),
        "shaping": None if shaper is None else shaper.state_dict(),
    }
    (output_dir / CHECKPOINT_FILE).write_text(json.dumps(state, indent=2) + "\n")
    return output_dir


def save_resume_state(model, tokenizer, optimizer, output_dir: Path, **checkpoint) -> None:
    """``output_dir/resume``: a checkpoint plus the optimizer state, written to a temporary
    directory and swapped in by renames, so an interruption leaves the old or the new one."""
    final, tmp, old = (output_dir / f"{RESUME_DIR}{suffix}" for suffix in ("", ".tmp", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp, **checkpoint)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def find_resume_state(output_dir: Path) -> Path | None:
    """The newest complete ``resume`` directory (``resume.old`` if a swap was interrupted)."""
    for name in (RESUME_DIR, f"{RESUME_DIR}.old"):
        if (output_dir / name / OPTIMIZER_FILE).exists():
            return output_dir / name
    return None


def check_resumable(state: dict[str, Any], train: TrainConfig, drpo: DRPOConfig | None) -> None:
    """Refuse to continue a run under other settings (``rollout_steps`` may grow)."""
    want = {
        "train": json.loads(json.dumps({**asdict(train), "rollout_steps": None})),
        "drpo": {} if drpo is None else json.loads(json.dumps(asdict(drpo))),
    }
    have = {"train": {**state["train"], "rollout_steps": None}, "drpo": state["drpo"] or {}}
    changed = [
        f"{part}.{key}"
        for part in want
        for key in sorted(want[part].keys() | have[part].keys())
        if want[part].get(key) != have[part].get(key)
    ]
    if state["method"] != train.method or changed:
        raise ValueError(
            f"cannot resume a {state['method']} run as {train.method}; changed settings: "
            f"{', '.join(changed) or 'none'} (use another --output or the same flags)"
        )


def prompt_batches(num_problems: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Indices of the prompts of each rollout: epochs over a seeded shuffle of the dataset."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            epoch = list(range(num_problems))
            rng.shuffle(epoch)
            order += epoch
        yield order[:batch_size]
        order = order[batch_size:]


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def train(
    model_dir: str | Path,
    problems: Sequence[Problem],
    output_dir: str | Path,
    train_config: TrainConfig,
    drpo_config: DRPOConfig | None = None,
    *,
    grader: Grader | None = None,
    device: str = "cpu",
    save_steps: int = 0,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Runs ``rollout_steps`` rollouts of RL from ``model_dir`` on ``device`` (``"cpu"`` or
    one GPU, e.g. ``"cuda"``); returns the checkpoint dir.

    Every rollout step's metrics go to ``output_dir/metrics.jsonl`` (and to ``log``). The
    resume state is saved every ``save_steps`` rollouts (0: at the end only); with
    ``resume`` a run continues from it, exactly as if it had not stopped.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    cfg = train_config
    layout = cfg.layout()
    micro = cfg.micro_batch_size
    is_drpo = cfg.method == DRPO
    drpo = (drpo_config or DRPOConfig()) if is_drpo else None
    shaper = (
        None
        if is_drpo
        else GroupRewardShaper(cfg.method, cfg.n_samples_per_prompt, **cfg.shaping_params)
    )
    grader = grader or load_grader()
    saved = find_resume_state(output_dir) if resume else None
    state = json.loads((saved / CHECKPOINT_FILE).read_text()) if saved else None
    if state is not None:
        check_resumable(state, cfg, drpo)
        if shaper is not None:
            shaper.load_state_dict(state["shaping"])
    init_model = state["init_model"] if state else str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(saved or model_dir)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(saved or model_dir, dtype=torch.float32)
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay
    )
    if saved:
        optimizer.load_state_dict(torch.load(saved / OPTIMIZER_FILE, map_location=device))
    first = state["step"] if state else 0
    encoded = [encode_prompt(tokenizer, p.prompt) for p in problems]
    batches = prompt_batches(len(problems), cfg.rollout_batch_size, cfg.seed)
    for _ in range(first):  # the prompts of the rollouts already trained on
        next(batches)
    metrics_path = output_dir / "metrics.jsonl"
    kept = metrics_path.read_text().splitlines()[:first] if metrics_path.exists() else []
    metrics_path.write_text("".join(line + "\n" for line in kept))
    checkpoint = dict(train=cfg, drpo=drpo, shaper=shaper, init_model=init_model)
    saved_step = None  # the step this call last saved a resume state at

    bar = tqdm(
        range(first, cfg.rollout_steps),
        desc=f"train {cfg.method}",
        unit="rollout",
        initial=first,
        total=cfg.rollout_steps,
        disable=not progress,
    )
    for step in bar:
        start = time.perf_counter()
        batch = next(batches)
        rollout = generate_rollout(
            model,
            tokenizer,
            [encoded[i] for i in batch],
            n=cfg.n_samples_per_prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=cfg.seed * 1_000_003 + step,
        )
        labels = [problems[batch[g]].label for g in rollout.group_ids.tolist()]
        correct = correctness_of(grader, rollout.texts, labels, model.device)
        rows = range(len(rollout.texts))
        with torch.no_grad():  # pi_old, in chunks of the micro-batch size
            old_log_probs = torch.cat(
                [
                    token_log_probs(model, rollout.select(rows[i : i + micro]), cfg.temperature)
                    for i in range(0, len(rows), micro)
                ]
            )
        plan = plan_optimizer_steps(rollout.group_ids.tolist(), cfg.n_samples_per_prompt, layout)
        step_metrics: list[dict[str, float]] = []
        if not is_drpo:
            prompts = [problems[i].prompt for i in batch]
            advantages, rewards = baseline_advantages(
                shaper, prompts, rollout, correct, cfg.estimator()
            )
        for k, micro_batches in enumerate(plan):
            if is_drpo:
                m = drpo_backward(
                    model,
                    rollout,
                    old_log_probs,
                    correct,
                    micro_batches,
                    drpo,
                    cfg,
                    policy_is_old=k == 0,
                )
            else:
                m = policy_gradient_backward(
                    model, rollout, old_log_probs, advantages, micro_batches, cfg
                )
            m["grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_metrics.append(m)

        lengths = rollout.num_tokens.float()
        record: dict[str, Any] = {
            "step": step + 1,
            "pass_rate": correct.float().mean().item(),
            "response_length": lengths.mean().item(),
            "truncated": rollout.truncated.float().mean().item(),
            "seconds": time.perf_counter() - start,
        }
        if not is_drpo:
            record["shaped_reward"] = _mean(rewards)
            signal = signal_diagnostics(advantages.tolist(), correct.tolist())
            record["frac_correct_negative_signal"] = signal["frac_correct_negative"]
        record.update({k: _mean([m[k] for m in step_metrics]) for k in step_metrics[0]})
        with metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if log is not None:
            log(record)
        bar.set_postfix(acc=f"{record['pass_rate']:.2f}", len=f"{record['response_length']:.0f}")
        if save_steps and (step + 1) % save_steps == 0:
            save_resume_state(model, tokenizer, optimizer, output_dir, step=step + 1, **checkpoint)
            saved_step = step + 1

    steps = max(first, cfg.rollout_steps)
    if saved_step != steps:
        save_resume_state(model, tokenizer, optimizer, output_dir, step=steps, **checkpoint)
    return save_checkpoint(model, tokenizer, output_dir, step=steps, **checkpoint)
