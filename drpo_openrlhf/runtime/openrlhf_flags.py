"""OpenRLHF flags a DRPO or baseline run reads, checked against OpenRLHF 0.11.2's own defaults
before anything starts.

OpenRLHF validates few of its flags itself, and late: ``--vllm.num_engines`` defaults to None
(no vLLM), under which 0.11.2 cannot generate and fails at the first rollout;
``--rollout.max_new_tokens`` defaults to None, under which each response may fill
``--data.max_len`` minus its prompt's tokens (``utils/agent.py``, ``SingleTurnAgentExecutor``)
and DRPO's length reward had no ``C``; a zero batch or GPU count divides by zero in the layout
check; a zero ``--data.max_len`` kills the vLLM engines at start-up. Each check here raises
``ValueError`` naming the flag and what to set; ``train.parse`` turns it into a usage error.
"""

from __future__ import annotations

import argparse

from drpo_openrlhf.flags import flag

# Integer flags that must be >= 1 whatever the run (None allowed only where listed below).
POSITIVE = (
    "actor.num_nodes",
    "actor.num_gpus_per_node",
    "vllm.num_engines",
    "vllm.tensor_parallel_size",
    "ds.tensor_parallel_size",
    "ds.ring_attn_size",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.micro_batch_size",
    "rollout.max_new_tokens",
    "rollout.max_tokens_per_gpu",
    "train.batch_size",
    "train.micro_batch_size",
    "train.max_tokens_per_gpu",
    "data.max_len",
)
# None means: OpenRLHF chooses (max_len - prompt per response; the training token budget).
MAY_BE_UNSET = ("rollout.max_new_tokens", "rollout.max_tokens_per_gpu")
ZERO_STAGES = (0, 1, 2, 3)
ACCUM_DTYPES = ("fp32", "bf16", "fp16")  # the spellings the memory plan and refusals read


def length_reward_c(args: argparse.Namespace) -> int:
    """``C`` of the length reward, which ``options.build_options`` puts in the run's
    ``DRPOConfig.max_len`` for every consumer: ``--drpo.max_len``, else the generation budget
    ``--rollout.max_new_tokens``, else ``--data.max_len``: with no budget set OpenRLHF lets a
    response fill ``--data.max_len`` minus its prompt (at least one token), so no response
    is longer than that and ``r_l`` stays in (0, 1]."""
    for name in ("drpo.max_len", "rollout.max_new_tokens"):
        if flag(args, name) is not None:
            return flag(args, name)
    return flag(args, "data.max_len")


def check(args: argparse.Namespace) -> None:
    """Refuse OpenRLHF flag values a run would die of after launch. Raises ``ValueError``."""
    if not flag(args, "actor.model_name_or_path"):
        raise ValueError(
            "--actor.model_name_or_path is required: the policy to train (a local Hugging Face "
            "model directory or a Hub id)"
        )
    if flag(args, "vllm.num_engines") is None:
        raise ValueError(
            "--vllm.num_engines is unset (OpenRLHF's default: no vLLM), but OpenRLHF 0.11.2 "
            "generates rollouts only with vLLM engines: set --vllm.num_engines N (N x "
            "--vllm.tensor_parallel_size GPUs; with --train.colocate_all, N x TP = the actor's "
            "GPUs)"
        )
    for name in POSITIVE:
        value = flag(args, name)
        if value is None and name in MAY_BE_UNSET:
            continue
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    engine_gpus = flag(args, "vllm.num_engines") * flag(args, "vllm.tensor_parallel_size")
    actor_gpus = flag(args, "actor.num_nodes") * flag(args, "actor.num_gpus_per_node")
    if (
        flag(args, "train.colocate_all")
        and not flag(args, "train.async_enable")
        and engine_gpus != actor_gpus
    ):  # OpenRLHF asserts it in train(), after Ray and the placement group are up
        raise ValueError(
            "--train.colocate_all shares each actor GPU with one vLLM engine rank: "
            f"--vllm.num_engines x --vllm.tensor_parallel_size ({engine_gpus}) must equal "
            f"--actor.num_nodes x --actor.num_gpus_per_node ({actor_gpus})"
        )
    zero = flag(args, "ds.zero_stage")
    if zero not in ZERO_STAGES:
        raise ValueError(f"--ds.zero_stage must be one of {ZERO_STAGES}, got {zero}")
    memory = flag(args, "vllm.gpu_memory_utilization")
    if not 0 < memory <= 1:
        raise ValueError(f"--vllm.gpu_memory_utilization must be in (0, 1], got {memory}")
    accum = flag(args, "ds.grad_accum_dtype")
    if accum is not None and accum not in ACCUM_DTYPES:
        raise ValueError(f"--ds.grad_accum_dtype must be one of {ACCUM_DTYPES}, got {accum!r}")
    budget, max_len = flag(args, "rollout.max_new_tokens"), flag(args, "data.max_len")
    if budget is not None and budget >= max_len:
        raise ValueError(
            f"--rollout.max_new_tokens {budget} leaves no room for the prompt in --data.max_len "
            f"{max_len} (prompt + response; vLLM's context): set --data.max_len to "
            f"{budget} plus the longest prompt"
        )
    kl = flag(args, "algo.kl.init_coef")
    if not kl >= 0:
        raise ValueError(f"--algo.kl.init_coef must be >= 0, got {kl}")
    _check_sampling_and_optimizer(args)
    if flag(args, "reward.remote_url") == "":
        raise ValueError(
            "--reward.remote_url is empty: give a reward file or URL (without the flag: the "
            "math reward)"
        )
    for name, lowest in (("drpo.logprob_chunk_tokens", 0), ("drpo.gpu_memory_gib", 0)):
        if flag(args, name) < lowest:
            raise ValueError(f"--{name} must be >= {lowest}, got {flag(args, name)}")
    gap = flag(args, "drpo.max_logprob_gap")
    if gap is not None and not gap > 0:
        raise ValueError(f"--drpo.max_logprob_gap must be > 0, got {gap}")


def _check_sampling_and_optimizer(args: argparse.Namespace) -> None:
    """The flags whose defaults DRPO sets (``train_defaults.DRPO_DEFAULTS``). vLLM refuses a
    negative temperature or a top_p outside (0, 1] at the first rollout, and the actor divides
    the logits by the temperature (0: infinite log-probs); torch's AdamW refuses betas outside
    [0, 1) and a negative learning rate or weight decay as the actor starts."""
    temperature = flag(args, "rollout.temperature")
    if not 0 < temperature < float("inf"):
        raise ValueError(f"--rollout.temperature must be > 0, got {temperature}")
    top_p = flag(args, "rollout.top_p")
    if not 0 < top_p <= 1:
        raise ValueError(f"--rollout.top_p must be in (0, 1], got {top_p}")
    betas = flag(args, "actor.adam.betas")
    if not all(0 <= b < 1 for b in betas):
        raise ValueError(f"--actor.adam.betas must be in [0, 1), got {list(betas)}")
    for name in ("actor.adam.lr", "actor.adam.weight_decay"):
        if not 0 <= flag(args, name) < float("inf"):
            raise ValueError(f"--{name} must be >= 0, got {flag(args, name)}")
