"""The run's options beyond OpenRLHF's own flags, read and decided once from the command line.

``build_options`` is the one reader of the ``--drpo.*`` and ``--shaping.*`` flags: it checks
them (against OpenRLHF's flags where they interact), decides what needs the model's files
(answer format, positive reward, the length reward's ``C``, the memory plan) and returns a
frozen ``RunOptions``. The driver prints from it and hands it to ``launch.run_openrlhf``,
which ships it to every Ray actor as ``strategy.args.drpo_run`` (its ``DRPOConfig`` also as
``strategy.args.drpo``), so what a worker reads is what the entry point decided.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.algo.rollout_correction import CORRECTION_FLAGS, rollout_correction
from drpo_openrlhf.flags import flag
from drpo_openrlhf.rewards import answer_format, positive_reward
from drpo_openrlhf.rewards._plugin import env_flag
from drpo_openrlhf.runtime import memory_plan, openrlhf_flags, preflight


@dataclass(frozen=True)
class RunOptions:
    """What a DRPO or baseline run was asked for besides OpenRLHF's flags, as decided."""

    drpo: DRPOConfig  # the loss's settings, ``max_len`` (C) resolved, ``positive_reward`` probed
    method: str | None  # --shaping.method: the baseline to run instead of DRPO
    params: Mapping[str, float | None]  # --shaping.params
    max_steps: int | None  # --drpo.max_steps
    max_steps_without_signal: int  # --drpo.max_steps_without_signal (0: never stop)
    max_logprob_gap: float | None  # --drpo.max_logprob_gap (None: derived from the run)
    device: str  # --drpo.device
    cpu_dtype: str  # --drpo.cpu_dtype: a CPU run's dtype (runtime/cpu_dtype.py)
    verify_weight_sync: bool  # --drpo.verify_weight_sync
    weight_probe: str  # --drpo.weight_probe
    allow_engine_difference: tuple[str, ...]  # --drpo.allow_engine_difference
    logprob_chunk_tokens: int  # --drpo.logprob_chunk_tokens (0: unchunked)
    ckpt_path: str  # --ckpt.path: where the stop request and the checkpoints live
    resume: bool  # --ckpt.load_enable
    answer_format: answer_format.AnswerFormat  # bound to the reward in every vLLM engine
    answer_format_line: str  # the answer format's line for the log
    memory_plan: str | None  # the estimated peak memory's table; None: no estimate


def drpo_config(args: argparse.Namespace) -> DRPOConfig:
    """``DRPOConfig`` from its ``--drpo.<field>`` flags, as given, and a DRPO run's rollout
    correction from OpenRLHF's ``--algo.advantage.is_correction_*`` (a baseline's PPO loss
    reads those itself)."""
    given = {
        f.name: flag(args, f"drpo.{f.name}")
        for f in fields(DRPOConfig)
        if f.name != "rollout_correction"
    }
    if not flag(args, "shaping.method"):
        flags = (flag(args, name) for name in CORRECTION_FLAGS)
        given["rollout_correction"] = rollout_correction(*flags)
    return DRPOConfig(**given)


def check_step_limits(args: argparse.Namespace) -> None:
    max_steps = flag(args, "drpo.max_steps")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"--drpo.max_steps must be >= 1, got {max_steps}")
    without_signal = flag(args, "drpo.max_steps_without_signal")
    if without_signal < 0:
        raise ValueError(f"--drpo.max_steps_without_signal must be >= 0, got {without_signal}")


def refuse_entropy_with_chunks(args: argparse.Namespace) -> None:
    """An entropy bonus needs every position's full logits, which chunked log-probs never
    hold (``update/chunked_actor.py``)."""
    if flag(args, "actor.entropy_coef") is not None and flag(args, "drpo.logprob_chunk_tokens"):
        raise ValueError(
            "--actor.entropy_coef needs the full logits: add --drpo.logprob_chunk_tokens 0 "
            "(OpenRLHF's unchunked forward; check the memory plan, docs/launch.md)"
        )


def refuse_tensor_parallel_with_chunks(args: argparse.Namespace) -> None:
    """DeepSpeed AutoTP replaces the output layer by a vocabulary-parallel one, which chunked
    log-probs (``update/chunked_actor.py``) do not compute with."""
    if flag(args, "ds.tensor_parallel_size") > 1 and flag(args, "drpo.logprob_chunk_tokens"):
        raise ValueError(
            "--ds.tensor_parallel_size splits the output layer over the vocabulary, which "
            "chunked log-probs do not handle: add --drpo.logprob_chunk_tokens 0 (OpenRLHF's "
            "unchunked forward; check the memory plan, docs/launch.md)"
        )


def refuse_truncated_sampling(args: argparse.Namespace) -> None:
    """DRPO scores each response under the full softmax at the sampling temperature (pi_old,
    the trust region's KL, the rollout gap); vLLM with top-p < 1 samples from the nucleus
    only, another policy. The released runs sample with top-p 1."""
    top_p = flag(args, "rollout.top_p")
    if top_p < 1 and "top_p" not in flag(args, "drpo.allow_engine_difference"):
        raise ValueError(
            f"--rollout.top_p {top_p}: vLLM would sample from the top-p nucleus while DRPO "
            "scores every response under the full softmax at --rollout.temperature, so the "
            "rollouts would come from another policy than the one it scores (the released runs "
            "sample with top_p 1.0): drop the flag, or add --drpo.allow_engine_difference top_p "
            "to train so anyway (docs/reliability.md)"
        )


def check_positive_reward(args: argparse.Namespace, config: DRPOConfig, baseline: bool) -> str:
    """``--drpo.positive_reward`` loaded and probed (``preflight``); returns it with its
    files' paths as the Ray workers will find them."""
    spec = config.positive_reward
    if positive_reward.is_default(spec):  # nothing to load or probe
        return spec
    if baseline:
        raise ValueError(
            "--drpo.positive_reward ranks DRPO's correct responses; the baselines "
            "(--shaping.method) shape rewards by length: drop one of the two"
        )
    return preflight.check_positive_reward(spec, config.length_c, config.length_reward)


def resolve_answer_format(args: argparse.Namespace) -> tuple[answer_format.AnswerFormat, str]:
    """The run's answer format (``rewards/answer_format.py``) and its line for the log. The
    trainer binds it to the reward in every vLLM engine (``ray_actors.bind_answer_format``);
    a flag given explicitly must reach it, and ``DRPO_REWARD_REQUIRE_THINK_END`` (the
    plugins' fallback for stock OpenRLHF) set otherwise on the driver must agree with it."""
    requested = flag(args, "drpo.answer_format")
    decided = answer_format.answer_format(flag(args, "actor.model_name_or_path"), requested)
    fallback = env_flag(answer_format.ENV_FALLBACK, decided.require_think_end)
    if fallback != decided.require_think_end and not decided.explicit:
        raise ValueError(
            f"{answer_format.ENV_FALLBACK}={os.environ[answer_format.ENV_FALLBACK]} is set, but "
            f"the entry point decided the {decided.line()} and binds it to the reward itself: "
            "say which with --drpo.answer_format thinking or plain, or unset the variable"
        )
    reward = (flag(args, "reward.remote_url") or "").split(",")[0].strip()
    if preflight.reward_takes(reward, "require_think_end"):
        return decided, decided.line()
    if decided.explicit:
        raise ValueError(
            f"--drpo.answer_format {requested}: the reward {reward or '(none)'} takes no "
            "require_think_end keyword (a reward file's reward_func needs that parameter or "
            "**kwargs), so the flag cannot reach it: drop the flag or add the parameter"
        )
    return decided, (
        f"{decided.line()}; not passed on: the reward {reward} takes no require_think_end and "
        "grades by its own rules"
    )


def build_options(args: argparse.Namespace) -> RunOptions:
    """The run's options from its parsed command line (defaults applied), once the model,
    reward and data have passed their checks (the answer format and the memory plan read the
    model's files). Raises ``ValueError`` naming the flag at fault."""
    method = flag(args, "shaping.method")
    check_step_limits(args)
    if method:
        refuse_entropy_with_chunks(args)
    else:
        refuse_truncated_sampling(args)
    config = replace(drpo_config(args), max_len=openrlhf_flags.length_reward_c(args))
    refuse_tensor_parallel_with_chunks(args)
    decided, line = resolve_answer_format(args)
    config = replace(config, positive_reward=check_positive_reward(args, config, bool(method)))
    memory = memory_plan.check(args)
    return RunOptions(
        drpo=config,
        method=method,
        params=flag(args, "shaping.params"),
        max_steps=flag(args, "drpo.max_steps"),
        max_steps_without_signal=flag(args, "drpo.max_steps_without_signal"),
        max_logprob_gap=flag(args, "drpo.max_logprob_gap"),
        device=flag(args, "drpo.device"),
        cpu_dtype=flag(args, "drpo.cpu_dtype"),
        verify_weight_sync=flag(args, "drpo.verify_weight_sync"),
        weight_probe=flag(args, "drpo.weight_probe"),
        allow_engine_difference=flag(args, "drpo.allow_engine_difference"),
        logprob_chunk_tokens=flag(args, "drpo.logprob_chunk_tokens"),
        ckpt_path=flag(args, "ckpt.path"),
        resume=flag(args, "ckpt.load_enable"),
        answer_format=decided,
        answer_format_line=line,
        memory_plan=memory.table() if memory else None,
    )
