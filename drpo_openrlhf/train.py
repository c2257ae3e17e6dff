"""``python -m drpo_openrlhf.train``: OpenRLHF 0.11.2's PPO entry point with DRPO's loss.

Accepts every OpenRLHF flag unchanged plus the ``--drpo.*`` group; ``--shaping.method``
instead runs one of the paper's baselines (PPO on length-shaped rewards). Parsing, defaults
and validation happen here, before anything GPU-side is imported, so ``--help`` and bad
flags are answered on any machine.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from drpo_openrlhf import process_tree
from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.algo.baseline_rewards import METHODS
from drpo_openrlhf.algo.config import KL_ESTIMATES, PENALTY_FORMS
from drpo_openrlhf.algo.group_shaper import GroupRewardShaper
from drpo_openrlhf.algo.length_reward import LENGTH_REWARDS
from drpo_openrlhf.algo.rollout_correction import CORRECTION_FLAGS, rollout_correction
from drpo_openrlhf.flags import flag
from drpo_openrlhf.rewards import answer_format
from drpo_openrlhf.runtime import dynamic_filter, memory_plan, openrlhf_flags, preflight
from drpo_openrlhf.runtime.checkpoint_check import check_checkpoint
from drpo_openrlhf.runtime.checkpoints import (
    innermost,
    interrupt_message,
    prepare_resume,
    stop_message,
)
from drpo_openrlhf.runtime.cpu_dtype import CPU_DTYPES
from drpo_openrlhf.runtime.device import DEVICES
from drpo_openrlhf.runtime.graceful_stop import StopRequested, clear_stale_request
from drpo_openrlhf.runtime.openrlhf_cli import check_openrlhf_validation, openrlhf_parser
from drpo_openrlhf.runtime.options import RunOptions, build_options
from drpo_openrlhf.runtime.tokenizer_check import check_tokenizer
from drpo_openrlhf.runtime.train_defaults import DRPO_DEFAULTS, baseline_defaults
from drpo_openrlhf.sync import engine_settings
from drpo_openrlhf.sync.weight_probe import GUARDS as PROBE_GUARDS
from drpo_openrlhf.update import signal_watch
from drpo_openrlhf.update.layout import layout_from_args
from drpo_openrlhf.update.signal_watch import NoLearningSignalError

# OpenRLHF flags that have no meaning for DRPO or break its groups: (flag, what to do instead)
REJECTED_FLAGS = {
    "--critic.model_name_or_path": "DRPO has no critic; drop it",
    "--actor.eps_clip": "DRPO has no ratio clipping; its trust region is --drpo.delta/--drpo.beta0",
    "--actor.eps_clip_low_high": "DRPO has no ratio clipping; use --drpo.delta/--drpo.beta0",
    "--actor.dual_clip": "DRPO has no ratio clipping; use --drpo.delta/--drpo.beta0",
    "--actor.policy_loss_type": "DRPO replaces the PPO/GSPO policy loss; drop it",
    "--actor.loss_agg_mode": "DRPO's loss is a mean over prompts of sequence scores; drop it",
    "--actor.entropy_coef": "DRPO has no entropy bonus (as in the paper); drop it",
    "--algo.kl.use_loss": "DRPO's KL term is its trust region (--drpo.delta/--drpo.beta0)",
    "--train.max_epochs": "DRPO takes one pass over each rollout (Algorithm 1); drop it",
}


def _lambda(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"lambda must be > 0 or inf, got {text}")
    return value


def _setting_names(text: str) -> tuple[str, ...]:
    names = tuple(sorted({name.strip() for name in text.split(",") if name.strip()}))
    unknown = [name for name in names if name not in engine_settings.ALLOWABLE]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown engine setting(s) {', '.join(unknown)}; the settings compared are "
            + ", ".join(engine_settings.ALLOWABLE)
        )
    return names


def add_drpo_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--drpo.*`` flags (the objective's defaults are ``DRPOConfig``'s), in the order
    a user reads them: the objective, the rewards, when a run stops, its resources."""
    g = parser.add_argument_group("DRPO (drpo_openrlhf)")
    d = DRPOConfig()
    _add_objective_arguments(g, d)
    _add_reward_arguments(g, d)
    _add_guard_arguments(g)
    _add_resource_arguments(g)


def _add_objective_arguments(g: argparse._ArgumentGroup, d: DRPOConfig) -> None:
    """The objective, its trust region and its per-prompt variants."""
    g.add_argument(
        "--drpo.lam",
        type=_lambda,
        default=d.lam,
        help="length-reward temperature lambda; 'inf' = DisCO (default %(default)s)",
    )
    g.add_argument(
        "--drpo.tau",
        type=float,
        default=d.tau,
        help="temperature of the negatives' log-sum-exp (default %(default)s)",
    )
    g.add_argument(
        "--drpo.delta",
        type=float,
        default=d.delta,
        help="trust-region radius on the token-mean KL(pi_old||pi) (default %(default)s)",
    )
    g.add_argument(
        "--drpo.beta0",
        type=float,
        default=d.beta0,
        help="squared-hinge penalty constant (default %(default)s)",
    )
    g.add_argument(
        "--drpo.penalty_form",
        choices=PENALTY_FORMS,
        default=d.penalty_form,
        help="'authors': gradient beta0[KL-delta]_+ (released code); 'paper': twice that",
    )
    g.add_argument(
        "--drpo.kl_estimate",
        choices=KL_ESTIMATES,
        default=d.kl_estimate,
        help="KL over the whole mini-batch (exact, Algorithm 1) or per micro-step",
    )
    g.add_argument(
        "--drpo.keep_all_wrong",
        action="store_true",
        help="all-wrong prompts keep their negative term",
    )
    g.add_argument(
        "--drpo.all_correct_length_signal",
        action="store_true",
        help="zero-mean length signal w_hat - 1/|S+| on all-correct prompts",
    )
    g.add_argument(
        "--drpo.lambda_by_pass_rate",
        action="store_true",
        help="per-prompt lambda / pass_rate (gentler length pressure on hard prompts)",
    )
    g.add_argument(
        "--drpo.pass_rate_prior",
        type=float,
        default=d.pass_rate_prior,
        help="with --drpo.lambda_by_pass_rate: shrink each prompt's pass rate towards 1/2 by "
        "this many pseudo-samples, so one sample's luck moves lambda less (default "
        "%(default)s: the group's own rate; docs/algorithm.md)",
    )


def _add_reward_arguments(g: argparse._ArgumentGroup, d: DRPOConfig) -> None:
    """What ranks the correct responses and how answers are read."""
    g.add_argument(
        "--drpo.length_reward",
        choices=LENGTH_REWARDS,
        default=d.length_reward,
        help="shape of r_l (default %(default)s)",
    )
    g.add_argument(
        "--drpo.max_len",
        type=int,
        default=None,
        help="C of the length reward (default: --rollout.max_new_tokens; where that is unset, "
        "--data.max_len, since OpenRLHF then lets each response fill --data.max_len minus its "
        "prompt)",
    )
    g.add_argument(
        "--drpo.positive_reward",
        default=d.positive_reward,
        metavar="SPEC",
        help="what ranks a prompt's correct responses: 'length' (r_l, default), "
        "'fewer_reflections', 'fewer_answers', path/to/file.py[:function] (default function "
        "positive_reward(texts, lengths, labels)), or a weighted sum such as "
        "'length+0.5*fewer_reflections' (docs/positive_rewards.md)",
    )
    g.add_argument(
        "--drpo.answer_format",
        choices=answer_format.FORMATS,
        default="auto",
        help="whether the reward reads answers after </think> ('thinking', the authors' "
        "contract) or whole where a response has none ('plain'); 'auto' decides from the "
        "model's chat template, and baselines use it too (default %(default)s; docs/rewards.md)",
    )


def _add_guard_arguments(g: argparse._ArgumentGroup) -> None:
    """When a run stops: its length, its learning signal and the weight-sync guards."""
    g.add_argument(
        "--drpo.max_steps",
        type=int,
        default=None,
        help="stop after this many rollout steps, then save the final model as usual "
        "(OpenRLHF 0.11.2 only counts episodes); applies to baselines too",
    )
    g.add_argument(
        "--drpo.max_steps_without_signal",
        type=int,
        default=signal_watch.DEFAULT_LIMIT,
        metavar="K",
        help="stop the run, before the update, after K rollouts in a row in which no prompt "
        "group can teach the update anything (all wrong, all correct: each step's line says "
        "why and what to change); 0: never stop; applies to baselines too (default "
        "%(default)s; docs/reliability.md)",
    )
    g.add_argument(
        "--drpo.max_logprob_gap",
        type=float,
        default=None,
        help="stop the run when one vLLM engine's rollout token log-probs differ from the "
        "actor's by more than this many nats on average (a stale or broken weight sync, a "
        "precision or kernel mismatch); logged as drpo/rollout_logprob_gap/engine_<i>. "
        "Default: 10 x the honest gap of the run's first rollout, whose weights are checked "
        "exactly (at least 0.005; that rollout must stay under 0.1; saved with the checkpoint, "
        "and a resumed run's first rollout must stay within 3 x it; 0.05 with "
        "--no-drpo.verify_weight_sync). Given, it replaces all of these; docs/reliability.md. "
        "Under --train.async_enable only responses sampled by pi_old's own weights are held to "
        "it (docs/async.md)",
    )
    g.add_argument(
        "--drpo.verify_weight_sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after every weight sync, check exactly (per-parameter digests) that each vLLM "
        "engine holds the weights the actor sent, and stop the run if not (default on; "
        "docs/launch.md)",
    )
    g.add_argument(
        "--drpo.weight_probe",
        choices=PROBE_GUARDS,
        default="all",
        help="after each weight check every vLLM engine and the actor score a fixed text; "
        "which differences stop the run: 'all' (an engine against the others, and against the "
        "actor), 'engines' (only against each other: engines meant to differ from the actor, "
        "e.g. fp8), 'actor' (only against the actor: engines meant to differ from each other), "
        "'log' (none; logged as drpo/probe_logprob_gap; docs/reliability.md)",
    )
    g.add_argument(
        "--drpo.allow_engine_difference",
        type=_setting_names,
        default=(),
        metavar="NAMES",
        help="comma-separated settings in which the vLLM engines may differ from the actor "
        f"(or from each other) without stopping the run, e.g. kv_cache_dtype for an fp8 KV "
        f"cache; the run still logs each difference ({', '.join(engine_settings.ALLOWABLE)}; "
        "docs/reliability.md)",
    )


def _add_resource_arguments(g: argparse._ArgumentGroup) -> None:
    """Memory, device and dtype."""
    g.add_argument(
        "--drpo.logprob_chunk_tokens",
        type=int,
        default=1024,
        help="compute the DRPO actor's token log-probs this many tokens at a time, so a "
        "micro-batch's full fp32 logits never exist at once (0: OpenRLHF's unchunked forward; "
        "default %(default)s: docs/launch.md, Memory plan)",
    )
    g.add_argument(
        "--drpo.gpu_memory_gib",
        type=float,
        default=memory_plan.DEFAULT_CAPACITY_GIB,
        help="memory of one GPU; the run is refused when its estimated peak needs more than "
        f"{round(100 * (1 - memory_plan.HEADROOM))}%% of it (0: no check; default "
        "%(default).1f, an 80 GB card: docs/launch.md, Memory plan)",
    )
    g.add_argument(
        "--drpo.device",
        choices=DEVICES,
        default="auto",
        help="GPU or CPU run; 'auto' asks the Ray cluster whether a process holding one of its "
        "GPUs sees CUDA, whatever the driver sees (default %(default)s; docs/gpu.md)",
    )
    g.add_argument(
        "--drpo.cpu_dtype",
        choices=CPU_DTYPES,
        default="auto",
        help="a CPU run's dtype for actor, reference and vLLM engines (a GPU run is bf16 as "
        "--ds.param_dtype says); 'auto': bf16 where the CPU has bf16 instructions (AVX512_BF16, "
        "AMX), else fp32, 40-60x faster there (default %(default)s; docs/cpu.md)",
    )


def _shaping_params(text: str) -> dict[str, float | None]:
    params: dict[str, float | None] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        params[name.strip()] = None if value.strip().lower() == "none" else float(value)
    return params


def add_shaping_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Baselines (drpo_openrlhf): PPO on length-shaped rewards")
    g.add_argument(
        "--shaping.method",
        choices=METHODS,
        default=None,
        help="run this baseline instead of DRPO (docs/baselines.md)",
    )
    g.add_argument(
        "--shaping.params",
        type=_shaping_params,
        default={},
        help="its hyper-parameters, e.g. 'alpha=0.2' or 'w=1,c=-0.7'",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = openrlhf_parser()
    parser.prog = "python -m drpo_openrlhf.train"
    parser.description = __doc__.splitlines()[0]
    add_drpo_arguments(parser)
    add_shaping_arguments(parser)
    return parser


def openrlhf_args_of(argv: list[str]) -> list[str]:
    """``argv`` without our ``--drpo.*`` and ``--shaping.*`` flags and their values."""
    ours = argparse.ArgumentParser(add_help=False)
    add_drpo_arguments(ours)
    add_shaping_arguments(ours)
    return ours.parse_known_args(argv)[1]


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_defaults(argv: list[str], defaults: dict[str, list[str]]) -> list[str]:
    extra = [
        x for flag, values in defaults.items() if not _given(argv, flag) for x in (flag, *values)
    ]
    return argv + extra


def refuse_unsafe_dynamic_batching(args: argparse.Namespace) -> None:
    """OpenRLHF 0.11.2's own actor update under dynamic batching runs DeepSpeed with one
    accumulation step and never marks the boundary, so ZeRO-1/2 keep only the last
    micro-batch's gradient of each optimizer step (docs/grouping.md). The DRPO actor marks it;
    the baselines run OpenRLHF's actor, so refuse the combination there."""
    if flag(args, "train.dynamic_batch_enable") and flag(args, "ds.zero_stage") < 3:
        raise ValueError(
            "--train.dynamic_batch_enable with --ds.zero_stage < 3 drops gradients in "
            "OpenRLHF's PPO update (only the last micro-batch of each step counts): use "
            "--ds.zero_stage 3 or fixed micro-batches for baseline runs"
        )


def refuse_sleep_with_bf16_optimizer(args: argparse.Namespace) -> None:
    """ZeRO-1 with bf16 weights and fp32 gradient accumulation (our default) runs on DeepSpeed's
    ``BF16_Optimizer``, which has no ``offload_states``: OpenRLHF's ``--ds.enable_sleep``
    calls it as the actor starts, so the run would die after Ray and vLLM are up. (With
    ``--ds.adam_offload`` DeepSpeed keeps its ZeRO optimizer and OpenRLHF skips the call.)"""
    if (
        flag(args, "ds.enable_sleep")
        and flag(args, "ds.zero_stage") == 1
        and flag(args, "ds.param_dtype") == "bf16"
        and flag(args, "ds.grad_accum_dtype") == "fp32"
        and not flag(args, "ds.adam_offload")
    ):
        raise ValueError(
            "--ds.enable_sleep cannot offload ZeRO-1's bf16 optimizer, which DeepSpeed uses "
            "with --ds.grad_accum_dtype fp32 (the default here): use --ds.zero_stage 3 (fp32 "
            "accumulation) or 2, or add --ds.grad_accum_dtype bf16 (docs/gpu.md)"
        )


def refuse_partial_rollout_with_prefix_cache(args: argparse.Namespace) -> None:
    """Under partial rollout a weight sync pauses responses and keeps their KV cache, so
    vLLM's prefix cache cannot be emptied then (its blocks are in use): a request after the
    sync would reuse a prompt's keys and values computed by the old weights, and the
    responses' weight versions (``algo/policy_lag.py``) would not say what sampled them."""
    if flag(args, "train.partial_rollout_enable") and flag(args, "vllm.enable_prefix_caching"):
        raise ValueError(
            "--train.partial_rollout_enable with --vllm.enable_prefix_caching: a request after "
            "a weight sync would reuse prompt keys and values the previous weights computed "
            "(the paused responses hold the cache); drop one of the two (docs/async.md)"
        )


def check_inputs(args: argparse.Namespace) -> None:
    """Model, reward file and local datasets, before anything starts (``preflight``); the
    model's files against the run (``checkpoint_check``), whose warnings go to stderr."""
    preflight.check_model(flag(args, "actor.model_name_or_path"))
    check_tokenizer(flag(args, "actor.model_name_or_path"))
    for warning in check_checkpoint(
        flag(args, "actor.model_name_or_path"),
        flag(args, "data.max_len"),
        flag(args, "data.apply_chat_template"),
    ):
        print(f"drpo_openrlhf: warning: {warning}", file=sys.stderr, flush=True)
    for name in ("ckpt.path", "ckpt.output_dir"):
        preflight.check_writable(flag(args, name), f"--{name}")
    for url in (flag(args, "reward.remote_url") or "").split(","):
        preflight.check_reward_file(url.strip())
    input_key, label_key = flag(args, "data.input_key"), flag(args, "data.label_key")
    for name in ("data.prompt_dataset", "eval.dataset"):
        if flag(args, name):
            preflight.check_prompt_data(flag(args, name), input_key, label_key)


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject what DRPO cannot run exactly. Raises ``ValueError``."""
    for option, advice in REJECTED_FLAGS.items():
        dest = option[2:]
        if flag(args, dest) != parser.get_default(dest):
            raise ValueError(f"{option} is not used by DRPO: {advice}")
    if flag(args, "algo.advantage.estimator") == "gae":
        raise ValueError("--algo.advantage.estimator gae needs a critic; DRPO uses none")
    rollout_correction(*(flag(args, name) for name in CORRECTION_FLAGS))  # or why not
    ring, tp = flag(args, "ds.ring_attn_size"), flag(args, "ds.tensor_parallel_size")
    if ring > 1 and tp > 1:
        raise ValueError(
            "--ds.ring_attn_size with --ds.tensor_parallel_size: DRPO is proven exact under "
            "each alone, not combined (docs/performance.md); use one of the two"
        )
    layout_from_args(args).check()


def parse(argv: list[str]) -> tuple[RunOptions, list[str]]:
    """The run options (``runtime/options.py``: the DRPO config as ``options.drpo``, baseline
    shaping, step limit, ...) and the OpenRLHF argv (defaults applied) of a command line.

    Exits with a usage error for unknown, invalid or DRPO-incompatible flags."""
    parser = build_parser()
    method = parser.parse_known_args(argv)[0].__dict__["shaping.method"]
    defaults = baseline_defaults(method) if method else DRPO_DEFAULTS
    args = parser.parse_args(with_defaults(argv, defaults))
    try:
        openrlhf_flags.check(args)
        if method:  # PPO on shaped rewards: OpenRLHF validates its own flags
            n = flag(args, "rollout.n_samples_per_prompt")
            GroupRewardShaper(method, n, **flag(args, "shaping.params"))
            refuse_unsafe_dynamic_batching(args)
        else:
            validate(args, parser)
        refuse_sleep_with_bf16_optimizer(args)
        refuse_partial_rollout_with_prefix_cache(args)
        check_inputs(args)
        options = build_options(args)
        openrlhf_argv = with_defaults(openrlhf_args_of(argv), defaults)
        check_openrlhf_validation(openrlhf_argv)
        given = _given(argv, dynamic_filter.RANGE)
        dynamic_filter.check_range(args, options.drpo, given)
    except ValueError as error:  # LayoutError included
        parser.error(str(error))
    return options, openrlhf_argv


def main(argv: list[str] | None = None) -> None:
    options, openrlhf_argv = parse(list(sys.argv[1:] if argv is None else argv))
    print(f"drpo_openrlhf: {options.answer_format_line}", flush=True)
    if options.memory_plan:
        print(f"Estimated peak GPU memory (docs/launch.md, Memory plan):\n{options.memory_plan}")
    else:
        print("No GPU memory estimate: --drpo.gpu_memory_gib 0, or no config.json for the model")
    from drpo_openrlhf.runtime.launch import run_openrlhf, shutdown_ray

    cleared = clear_stale_request(options.ckpt_path)
    if cleared:
        print(f"drpo_openrlhf: {cleared}", flush=True)
    if options.resume:
        print(f"drpo_openrlhf: {prepare_resume(options.ckpt_path)}", flush=True)
    # A stopping run's last line says why; a signal meanwhile (its launcher's, a second
    # Ctrl-C) must not cut it off, as the SIGTERM handler of Ray's driver would (SystemExit).
    try:
        run_openrlhf(openrlhf_argv, options)
    except (KeyboardInterrupt, SystemExit) as stop:
        interrupted = process_tree.interruption(stop)
        if interrupted is None:
            raise
        with process_tree.uninterrupted():
            print(f"drpo_openrlhf: interrupted by {interrupted.name}: stopping", file=sys.stderr)
            shutdown_ray()  # the actors' last words (Ray forwards them) come before the run's
            message = interrupt_message(interrupted.name, options.ckpt_path)
            print(f"drpo_openrlhf: {message}", file=sys.stderr, flush=True)
        raise SystemExit(interrupted.exit_code) from None
    except Exception as error:
        with process_tree.uninterrupted():
            cause = innermost(error)
            if isinstance(cause, StopRequested):  # the step is saved: a clean end
                print(f"drpo_openrlhf: {cause}", flush=True)
                return
            if not isinstance(cause, NoLearningSignalError):  # a diagnosis, not a crash
                traceback.print_exc()
            message = stop_message(error, options.ckpt_path)
            print(f"drpo_openrlhf: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    from drpo_openrlhf.runtime.process_exit import exit_now

    process_tree.interrupt_on_signals()  # SIGTERM unwinds as Ctrl-C does
    code: int | str | None = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt as stop:  # while the flags and inputs were checked
        interrupted = process_tree.as_interrupted(stop)
        said = f"interrupted by {interrupted.name} before the run started"
        print(f"drpo_openrlhf: {said}", file=sys.stderr)
        code = interrupted.exit_code
    process_tree.exiting()  # a signal now would cut the exit handlers short (Ray's shutdown)
    exit_now(code)
