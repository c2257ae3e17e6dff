import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_pipeline import train as run_train

from drpo_openrlhf import train
from drpo_openrlhf.runtime import train_defaults

BASE = [
    "--actor.model_name_or_path",
    "some/model",
    "--vllm.num_engines",
    "8",
    "--rollout.n_samples_per_prompt",
    "8",
    "--rollout.batch_size",
    "128",
    "--train.batch_size",
    "256",
    "--train.micro_batch_size",
    "4",
]


def value_after(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    values = []
    for a in argv[i + 1 :]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def test_help_shows_both_groups_without_importing_gpu_modules():
    code = (
        "import sys\n"
        "from drpo_openrlhf.train import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('GPU modules imported:', [m for m in ('vllm', 'flash_attn') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--actor.model_name_or_path" in out.stdout and "--drpo.lam" in out.stdout
    assert "--drpo.kl_estimate {minibatch,microstep}" in out.stdout
    assert "GPU modules imported: []" in out.stdout


def test_parse_applies_drpo_defaults_and_keeps_user_values():
    options, argv = train.parse(
        [
            *BASE,
            "--drpo.lam",
            "inf",
            "--drpo.tau",
            "5",
            "--actor.adam.lr",
            "2e-6",
            "--rollout.temperature",
            "0.7",
        ]
    )
    config = options.drpo
    assert math.isinf(config.lam) and config.tau == 5
    assert config.max_len == 2048  # no --rollout.max_new_tokens: C = --data.max_len
    assert not any(a.startswith("--drpo.") for a in argv)
    assert value_after(argv, "--algo.kl.init_coef") == ["0"]
    assert value_after(argv, "--actor.adam.betas") == ["0.9", "0.999"]
    assert value_after(argv, "--actor.lr_scheduler") == ["constant"]
    assert value_after(argv, "--reward.remote_url") == [train_defaults.MATH_REWARD]
    math_reward = Path(train_defaults.MATH_REWARD)
    assert math_reward.is_absolute() and math_reward.is_file()
    assert value_after(argv, "--rollout.temperature") == ["0.7"]
    assert argv.count("--rollout.temperature") == 1


def test_drpo_options_reach_the_config():
    config = train.parse(
        [
            *BASE,
            "--drpo.keep_all_wrong",
            "--drpo.penalty_form",
            "paper",
            "--drpo.length_reward",
            "cosine",
            "--drpo.max_len",
            "4096",
            "--drpo.lambda_by_pass_rate",
            "--drpo.pass_rate_prior",
            "4",
        ]
    )[0].drpo
    assert config.keep_all_wrong and config.penalty_form == "paper"
    assert config.length_reward == "cosine" and config.max_len == 4096
    assert config.lambda_by_pass_rate and config.pass_rate_prior == 4.0


def test_top_p_below_1_is_drpos_refusal_unless_allowed_and_a_baselines_choice():
    """vLLM samples from the nucleus, DRPO scores the full softmax: refused, allowed by name;
    a baseline's PPO keeps OpenRLHF's meaning."""
    options, argv = train.parse(
        [*BASE, "--rollout.top_p", "0.95", "--drpo.allow_engine_difference", "top_p"]
    )
    assert options.allow_engine_difference == ("top_p",)
    assert argv[argv.index("--rollout.top_p") + 1] == "0.95"
    baseline = ("--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2")
    train.parse([*BASE, "--rollout.top_p", "0.95", *baseline])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--actor.eps_clip", "0.3"], "no ratio clipping"),
        (["--train.max_epochs", "2"], "one pass over each rollout"),
        (["--critic.model_name_or_path", "x"], "no critic"),
        (["--algo.advantage.estimator", "gae"], "needs a critic"),
        (["--algo.kl.use_loss"], "trust region"),
        (["--train.micro_batch_size", "3"], "must divide the 32 responses"),
        (["--drpo.lam", "0"], "lambda must be > 0"),
        (["--drpo.penalty_form", "half"], "invalid choice"),
        (["--drpo.max_steps", "0"], "--drpo.max_steps must be >= 1"),
        (["--drpo.pass_rate_prior", "4"], "turn that on"),
        (
            ["--drpo.allow_engine_difference", "dtype,kv_dtype"],
            "unknown engine setting(s) kv_dtype",
        ),
        (["--rollout.top_p", "0.95"], "from the top-p nucleus while DRPO scores"),
        (["--no.such.flag", "1"], "unrecognized arguments"),
    ],
)
def test_incompatible_or_invalid_flags_are_usage_errors(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse([*BASE, *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_paper_batch_runs_on_64_gpus_and_refuses_a_rank_count_that_does_not_divide_it():
    """Groups may be split over ranks (cross-rank layout): 8 nodes x 8 GPUs at 256 responses
    per optimizer step; 48 ranks cannot share 256 responses evenly."""
    train.parse([*BASE, "--actor.num_nodes", "8", "--actor.num_gpus_per_node", "8"])
    train.parse([*BASE, "--actor.num_gpus_per_node", "64", "--train.micro_batch_size", "1"])
    with pytest.raises(SystemExit):
        train.parse([*BASE, "--actor.num_gpus_per_node", "48"])
    argv = [*BASE, "--actor.num_gpus_per_node", "48", "--train.dynamic_batch_enable"]
    _, openrlhf_argv = train.parse(argv)
    assert "--train.dynamic_batch_enable" in openrlhf_argv


def test_ring_attn_size_is_accepted_and_the_layout_counts_ring_groups(capsys):
    """Under ring attention the ranks of a ring group share responses: 512 GPUs cannot share
    256 responses per step, their 128 ring groups of 4 can (2 each)."""
    gpus = ["--actor.num_nodes", "64", "--actor.num_gpus_per_node", "8"]
    argv = [*BASE, *gpus, "--train.micro_batch_size", "2"]
    with pytest.raises(SystemExit):
        train.parse(argv)
    _, openrlhf_argv = train.parse([*argv, "--ds.ring_attn_size", "4"])
    assert value_after(openrlhf_argv, "--ds.ring_attn_size") == ["4"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.parse([*BASE, "--actor.num_gpus_per_node", "6", "--ds.ring_attn_size", "4"])
    assert "(4 x 1) must divide the 6 actor GPUs" in capsys.readouterr().err


def test_tensor_parallel_size_is_accepted_with_unchunked_log_probs(capsys):
    """AutoTP's output layer is vocabulary-parallel, which chunked log-probs do not handle;
    the layout counts TP groups; ring attention and TP together are refused (not tested)."""
    tp = ["--actor.num_gpus_per_node", "16", "--ds.tensor_parallel_size", "2"]
    with pytest.raises(SystemExit):
        train.parse([*BASE, *tp])
    assert "--drpo.logprob_chunk_tokens 0" in capsys.readouterr().err
    _, openrlhf_argv = train.parse([*BASE, *tp, "--drpo.logprob_chunk_tokens", "0"])
    assert value_after(openrlhf_argv, "--ds.tensor_parallel_size") == ["2"]
    with pytest.raises(SystemExit):
        train.parse([*BASE, *tp, "--drpo.logprob_chunk_tokens", "0", "--ds.ring_attn_size", "2"])
    assert "each alone, not combined" in capsys.readouterr().err


def test_ring_attention_is_refused_on_a_cpu_run(entry_point, capsys):
    """Ring attention runs on flash-attn's CUDA kernels; the CPU pipeline has none."""
    argv = [*BASE, "--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    assert "flash-attn's CUDA kernels" in capsys.readouterr().err
    assert "name" not in entry_point  # OpenRLHF never started


def test_vllm_tensor_parallel_is_refused_on_a_cpu_run(entry_point, capsys):
    """OpenRLHF starts a TP engine on vLLM's Ray executor, which vLLM's CPU build refuses: the
    engine died at start-up and the run waited (issue 34, finding 7)."""
    with pytest.raises(SystemExit) as exit_info:
        train.main([*BASE, "--vllm.tensor_parallel_size", "2"])
    assert exit_info.value.code == 2
    assert "--vllm.tensor_parallel_size > 1 runs vLLM's Ray executor" in capsys.readouterr().err
    assert "name" not in entry_point  # OpenRLHF never started


def test_flags_at_their_openrlhf_default_are_accepted():
    train.parse([*BASE, "--train.max_epochs", "1", "--actor.eps_clip", "0.2"])


def test_every_rejected_flag_exists_in_openrlhf():
    options = set(train.build_parser()._option_string_actions)
    assert set(train.REJECTED_FLAGS) <= options and set(train.DRPO_DEFAULTS) <= options


@pytest.fixture
def entry_point(monkeypatch):
    """``train.main`` up to OpenRLHF's ``__main__``: what the run would start with, recorded
    (``seen``) instead of run. CPU mode is process-wide (torch.cuda answers, a Ray cluster),
    so its two calls are recorded in ``seen["cpu"]`` rather than made."""
    import openrlhf.trainer.ray as openrlhf_ray
    import openrlhf.utils.config as openrlhf_config
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    from drpo_openrlhf.runtime import cpu_support, launch
    from drpo_openrlhf.runtime.device import ClusterDevices
    from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser

    for module, name in [
        (openrlhf_config, "hierarchize"),
        (ppo_actor, "PolicyModelActor"),
        (ppo_trainer, "PPOTrainer"),
        (vllm_engine, "RolloutRayActor"),
        (openrlhf_ray, "create_vllm_engines"),
    ]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    seen = {"cpu": [], "stock_actor": ppo_actor.PolicyModelActor}
    monkeypatch.setattr(cpu_support, "enable", lambda: seen["cpu"].append("enable"))
    monkeypatch.setattr(launch, "init_cpu_ray", lambda args, address: seen["cpu"].append(args))
    # a CPU cluster, whatever Ray cluster this machine may be running (test_device_mode.py)
    monkeypatch.setattr(
        launch, "resolve_mode", lambda requested: ("cpu", ClusterDevices(None, 0.0, None))
    )

    def fake_run_module(name, run_name, alter_sys):
        args = openrlhf_config.hierarchize(openrlhf_parser().parse_args(sys.argv[1:]))
        seen.update(
            name=name,
            run_name=run_name,
            argv=list(sys.argv),
            args=args,
            actor=ppo_actor.PolicyModelActor,
            trainer=ppo_trainer.PPOTrainer,
            rollout=vllm_engine.RolloutRayActor,
        )

    monkeypatch.setattr(runpy, "run_module", fake_run_module)
    return seen


def test_main_runs_openrlhf_with_the_drpo_actors(entry_point):
    from drpo_openrlhf.runtime import engine_actors, policy_actors, ray_actors

    seen = entry_point
    train.main([*BASE, "--drpo.lam", "0.2", "--drpo.max_steps", "7"])
    assert seen["name"] == "openrlhf.cli.train_ppo_ray" and seen["run_name"] == "__main__"
    assert seen["actor"] is policy_actors.DRPOPolicyModelActor
    assert seen["trainer"] is ray_actors.GroupAwarePPOTrainer
    assert seen["args"].drpo_run.method is None and seen["args"].drpo_run.max_steps == 7
    assert seen["args"].drpo.lam == 0.2 and seen["args"].algo.kl.init_coef == 0
    assert "--drpo.lam" not in seen["argv"]
    # no GPU here: CPU support on, Ray started for the run's own argv, CPU vLLM engines
    assert seen["cpu"][0] == "enable"
    assert seen["cpu"][1]["actor.model_name_or_path"] == "some/model"
    assert seen["rollout"] is engine_actors.CPURolloutRayActor


def test_a_drpo_run_takes_the_correction_flags_from_openrlhfs_loss(entry_point):
    """DRPO reads --algo.advantage.is_correction_* into its config and hands OpenRLHF's PPO
    loss, which it replaces, the correction off (its constructor refuses a sequence-level
    clip); a baseline's PPO loss keeps them."""
    flags = ["--algo.advantage.is_correction_level", "seq"]
    flags += ["--algo.advantage.is_correction_mode", "clip"]
    train.main([*BASE, *flags])
    args = entry_point["args"]
    assert (args.drpo.rollout_correction.level, args.drpo.rollout_correction.mode) == (
        "seq",
        "clip",
    )
    assert args.algo.advantage.is_correction_level == "off"
    baseline = ["--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2"]
    train.main([*BASE, *baseline, "--algo.advantage.is_correction_level", "token"])
    assert entry_point["args"].algo.advantage.is_correction_level == "token"


def test_main_removes_a_stale_stop_request_before_the_run_starts(
    entry_point, tmp_path, monkeypatch, capsys
):
    """A requeued run must not stop after its first step on the request that stopped the
    previous one (runtime/graceful_stop.py)."""
    from drpo_openrlhf.runtime.graceful_stop import STOP_FILE

    request = tmp_path / STOP_FILE
    request.touch()
    requested_at_start = []
    monkeypatch.setattr(
        runpy, "run_module", lambda *args, **kwargs: requested_at_start.append(request.exists())
    )
    train.main([*BASE, "--ckpt.path", str(tmp_path), "--ckpt.load_enable"])
    assert requested_at_start == [False]
    out = capsys.readouterr().out
    assert f"drpo_openrlhf: removed the stop request {request} left by an earlier run" in out
    assert out.index("removed the stop request") < out.index("drpo_openrlhf: no checkpoint in")


def test_main_ends_cleanly_when_the_trainer_stopped_on_request(entry_point, monkeypatch, capsys):
    """The trainer's ``StopRequested`` reaches the driver inside Ray's ``RayTaskError``: the
    step is saved, so the run ends with exit 0 and one line, not a stop message."""
    from ray.exceptions import RayTaskError

    from drpo_openrlhf.runtime.graceful_stop import StopRequested

    def stopped_trainer(*args, **kwargs):
        try:
            raise StopRequested("stop requested: saved global_step7, stopping")
        except StopRequested as cause:
            raise RayTaskError("fit", "traceback", cause).as_instanceof_cause() from None

    monkeypatch.setattr(runpy, "run_module", stopped_trainer)
    train.main(BASE)  # returns: exit 0
    captured = capsys.readouterr()
    assert "drpo_openrlhf: stop requested: saved global_step7, stopping\n" in captured.out
    assert "Traceback" not in captured.err and "the run stopped" not in captured.err


def shell_command_lines(text: str, start: str) -> list[str]:
    """The whitespace-split words of the continued shell command beginning with ``start``."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip().startswith(start))
    words = []
    for line in lines[i:]:
        words += line.strip().rstrip("\\").split()
        if not line.rstrip().endswith("\\"):
            return words
    return words


def test_documented_command_parses():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    words = shell_command_lines(text, "python -m drpo_openrlhf.train")
    argv = [w.strip('"') for w in words[3:]]
    options, openrlhf_argv = train.parse(argv)
    assert options.drpo.lam == 0.1 and "--actor.model_name_or_path" in openrlhf_argv


def test_baseline_mode_keeps_ppo_and_sets_the_papers_estimator():
    shaping, argv = train.parse(
        [
            *BASE,
            "--shaping.method",
            "rloo_lp",
            "--shaping.params",
            "alpha=0.2",
            "--actor.eps_clip",
            "0.2",
        ]
    )
    assert shaping.method == "rloo_lp" and shaping.params == {"alpha": 0.2}
    assert value_after(argv, "--algo.advantage.estimator") == ["rloo"]
    assert "--algo.kl.init_coef" not in argv and "--shaping.method" not in argv
    shaping, argv = train.parse([*BASE, "--shaping.method", "hapo", "--shaping.params", "w=0.1"])
    assert value_after(argv, "--algo.advantage.estimator") == ["group_norm"]
    dynamic = ["--train.dynamic_batch_enable", "--ds.zero_stage", "3"]
    train.parse([*BASE, "--shaping.method", "hapo", "--shaping.params", "w=0.1", *dynamic])


ZERO2_DYNAMIC = ["--train.dynamic_batch_enable", "--ds.zero_stage", "2"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--shaping.method", "alp"], "alp needs beta"),
        (["--shaping.method", "hapo", "--shaping.params", "w=2"], "w must be"),
        (["--shaping.method", "rloo_lp", "--shaping.params", "alpha"], "expected key=value"),
        (["--shaping.method", "grpo"], "invalid choice"),
        (
            ["--shaping.method", "hapo", "--shaping.params", "w=0.1", *ZERO2_DYNAMIC],
            "drops gradients",
        ),
    ],
)
def test_bad_baseline_settings_are_usage_errors(extra, message, capsys):
    with pytest.raises(SystemExit):
        train.parse([*BASE, *extra])
    assert message in capsys.readouterr().err


def test_main_in_baseline_mode_keeps_openrlhfs_actor(entry_point):
    """Baselines train with OpenRLHF's PPO update; only the sync check, the complete-checkpoint
    marker, chunked log-probs and the non-finite update check are added to it."""
    from drpo_openrlhf.runtime.checkpoints import CompleteCheckpointActor
    from drpo_openrlhf.runtime.policy_actors import (
        BaselinePolicyModelActor,
        _BaselinePolicyModelActor,
    )
    from drpo_openrlhf.runtime.ray_actors import GroupAwarePPOTrainer
    from drpo_openrlhf.sync.sync_check import SentDigestsActor

    train.main([*BASE, "--shaping.method", "hapo", "--shaping.params", "w=1"])
    assert entry_point["actor"] is BaselinePolicyModelActor
    stock = entry_point["stock_actor"].__ray_actor_class__
    mixins = (CompleteCheckpointActor, SentDigestsActor)
    assert _BaselinePolicyModelActor.__bases__ == (*mixins, stock)
    assert all("fit" not in vars(c) for c in (_BaselinePolicyModelActor, *mixins))
    assert entry_point["trainer"] is GroupAwarePPOTrainer


def test_reward_path_is_relative_inside_a_ray_working_dir_copy(tmp_path, monkeypatch):
    copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    (copy / "drpo_openrlhf" / "rewards").mkdir(parents=True)
    monkeypatch.setattr(train_defaults, "PACKAGE", copy / "drpo_openrlhf")
    monkeypatch.chdir(copy)
    assert train_defaults.reward_plugin_path() == "drpo_openrlhf/rewards/math_reward.py"


def _bad_inputs(toy, tmp_path: Path) -> list[tuple[list[str], str]]:
    no_func = tmp_path / "reward_no_func.py"
    no_func.write_text("def reward(queries, prompts, labels):\n    return {}\n")
    broken = tmp_path / "reward_broken.py"
    broken.write_text("def reward_func(queries, prompts, labels:\n")
    unlabelled = tmp_path / "unlabelled.jsonl"
    rows = [*toy["train"].read_text().splitlines()[:3], '{"prompt": "Compute 1+1."}']
    unlabelled.write_text("\n".join(rows) + "\n")
    return [
        (["--reward.remote_url", str(no_func)], "defines no top-level reward_func"),
        (["--reward.remote_url", str(broken)], "syntax error, line 1"),
        (["--data.prompt_dataset", str(unlabelled)], "row 4: no 'label'"),
        (["--actor.model_name_or_path", str(tmp_path / "missing")], "no such directory"),
        (["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"], "not supported without"),
    ]


def test_bad_inputs_end_the_run_with_a_clear_error(toy, tmp_path):
    """Each through ``python -m drpo_openrlhf.train`` as a user starts it: exit status 2 and the
    reason, before any training process starts. (Its own module's worker: no run gets far
    enough to need the pipeline modules' one-at-a-time, tests/conftest.py.)"""
    for flags, message in _bad_inputs(toy, tmp_path):
        done = run_train(toy, tmp_path / "bad", *flags, ray_address=None)
        assert done.returncode == 2, (flags, done.output[-2000:])
        assert message in done.output, (flags, done.output[-2000:])


@pytest.mark.parametrize(
    ("kernels", "extra", "dtype"),
    [
        ("AVX2", [], "fp32"),
        ("AVX2", ["--ds.param_dtype", "bf16"], "fp32"),  # a recipe's GPU flag: cpu_dtype decides
        ("AVX2", ["--drpo.cpu_dtype", "bf16"], "bf16"),
        ("AMX", [], "bf16"),
        ("AMX", ["--drpo.cpu_dtype", "fp32"], "fp32"),
    ],
)
def test_a_cpu_runs_dtype_reaches_the_actor_args_and_the_engines_env(
    entry_point, monkeypatch, caplog, kernels, extra, dtype
):
    from drpo_openrlhf.runtime import cpu_dtype

    native = kernels == "AMX"
    found = cpu_dtype.CPUKernels(kernels, bf16_instructions=native, onednn_max_isa=None)
    monkeypatch.setattr(cpu_dtype, "read_kernels", lambda: found)
    monkeypatch.setenv(cpu_dtype.ENV, "unset")  # restored after the test
    with caplog.at_level("WARNING"):
        train.main([*BASE, *extra])
    assert entry_point["args"].ds.param_dtype == dtype
    assert cpu_dtype.engine_dtype() == cpu_dtype.VLLM_DTYPE[dtype]
    assert f"CPU run in {dtype}: actor, reference and vLLM engines" in caplog.text
    overridden = "--ds.param_dtype bf16 is a GPU run's; on CPU --drpo.cpu_dtype decides (fp32)"
    assert (overridden in caplog.text) == ("--ds.param_dtype" in extra)


def test_a_cpu_runs_ray_env_carries_the_dtype(monkeypatch):
    import ray

    from drpo_openrlhf.runtime import cpu_dtype, launch

    started = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.update(kwargs))
    monkeypatch.setenv(cpu_dtype.ENV, "fp32")
    launch.init_cpu_ray({}, address="127.0.0.1:6379")
    assert started["runtime_env"]["env_vars"][cpu_dtype.ENV] == "fp32"


@pytest.fixture
def ray_driver_sigterm():
    """The SIGTERM handler that ``ray.init`` installs in a driver (``ray/_private/worker.py``:
    ``sys.exit(signum)``), for the test; the worker's own handlers are back after it."""
    import signal

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_signal_while_the_run_stops_does_not_cut_off_why(
    entry_point, ray_driver_sigterm, monkeypatch, capsys
):
    """A Ray actor dies, and the launcher's SIGTERM (a demo or sweep passing its own on)
    arrives while the driver prints why it stopped: the run still says why and exits 1. It
    ended with 15 and no word once, its traceback the log's last lines."""
    import signal

    from ray.exceptions import ActorDiedError

    def actor_died(*args, **kwargs):
        raise ActorDiedError()

    def signalled_meanwhile(error, ckpt_path):
        signal.raise_signal(signal.SIGTERM)
        return stop_message(error, ckpt_path)

    stop_message = train.stop_message
    monkeypatch.setattr(runpy, "run_module", actor_died)
    monkeypatch.setattr(train, "stop_message", signalled_meanwhile)
    with pytest.raises(SystemExit) as exit_info:
        train.main(BASE)
    assert exit_info.value.code == 1
    assert "drpo_openrlhf: the run stopped: a Ray actor process died" in capsys.readouterr().err


def test_a_second_signal_while_an_interrupted_run_stops_does_not_cut_off_why(
    entry_point, ray_driver_sigterm, monkeypatch, capsys
):
    """SIGTERM (Ray's handler: SystemExit(15)), then another during Ray's shutdown: the run
    still shuts down, says so and exits 143."""
    import signal

    from drpo_openrlhf.runtime import launch

    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    shutdowns = []
    monkeypatch.setattr(runpy, "run_module", signalled)
    monkeypatch.setattr(launch, "shutdown_ray", lambda: (signalled(), shutdowns.append(1)))
    with pytest.raises(SystemExit) as exit_info:
        train.main(BASE)
    assert exit_info.value.code == 143 and shutdowns == [1]
    assert "drpo_openrlhf: the run stopped on SIGTERM." in capsys.readouterr().err
