"""The run's options (``runtime/options.py``): built once from the command line, every field
from its flag, frozen and picklable (they travel to every Ray actor); the one flag accessor
and the one layout builder read OpenRLHF's flat and nested flags alike."""

from __future__ import annotations

import argparse
import pickle
from dataclasses import FrozenInstanceError, asdict, fields
from types import SimpleNamespace

import pytest
from openrlhf.utils.config import hierarchize

from drpo_openrlhf import train
from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.flags import flag
from drpo_openrlhf.runtime.options import RunOptions
from drpo_openrlhf.update.layout import Layout, layout_from_args

# the 1.5B recipe's model, whose shape is known offline: the memory plan runs
BASE = [
    *("--actor.model_name_or_path", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2"),
    *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4"),
    *("--train.batch_size", "16", "--train.micro_batch_size", "2"),
    *("--rollout.max_new_tokens", "512", "--data.max_len", "1024"),
]
# what ``train.parse`` returned as a SimpleNamespace before the options were typed
OLD_RUN_ATTRIBUTES = (
    "method",
    "params",
    "max_steps",
    "max_steps_without_signal",
    "max_logprob_gap",
    "device",
    "verify_weight_sync",
    "weight_probe",
    "allow_engine_difference",
    "logprob_chunk_tokens",
    "ckpt_path",
    "resume",
    "answer_format",
    "answer_format_line",
    "memory_plan",
)


def changed_run(tmp_path) -> list[str]:
    """Every run option's flag away from its default."""
    return [
        *BASE,
        *("--drpo.lam", "0.2", "--drpo.max_len", "300"),
        *("--drpo.max_steps", "7", "--drpo.max_steps_without_signal", "0"),
        *("--drpo.max_logprob_gap", "0.5", "--drpo.device", "cpu"),
        *("--no-drpo.verify_weight_sync", "--drpo.weight_probe", "log"),
        *("--drpo.allow_engine_difference", "kv_cache_dtype, device,kv_cache_dtype"),
        *("--drpo.logprob_chunk_tokens", "512", "--drpo.answer_format", "plain"),
        *("--drpo.gpu_memory_gib", "0", "--ckpt.path", str(tmp_path / "ckpt")),
        *("--ckpt.load_enable", "--drpo.cpu_dtype", "fp32"),
    ]


def test_the_options_hold_every_old_run_attribute_and_the_drpo_config():
    options, _ = train.parse(BASE)
    assert isinstance(options, RunOptions) and isinstance(options.drpo, DRPOConfig)
    assert {f.name for f in fields(RunOptions)} == {"drpo", "cpu_dtype", *OLD_RUN_ATTRIBUTES}
    assert options.method is None and options.params == {}
    assert options.memory_plan and options.answer_format_line.startswith("answer format: ")


def test_every_option_comes_from_its_flag(tmp_path):
    default, _ = train.parse(BASE)
    changed, _ = train.parse(changed_run(tmp_path))
    same = [
        f.name for f in fields(RunOptions) if getattr(changed, f.name) == getattr(default, f.name)
    ]
    assert same == ["method", "params"]  # a baseline's: below
    assert changed.drpo == DRPOConfig(lam=0.2, max_len=300)
    assert (changed.max_steps, changed.max_steps_without_signal) == (7, 0)
    assert (changed.max_logprob_gap, changed.device) == (0.5, "cpu")
    assert (changed.verify_weight_sync, changed.weight_probe) == (False, "log")
    assert (default.allow_engine_difference, changed.allow_engine_difference) == (
        (),
        ("device", "kv_cache_dtype"),
    )
    assert changed.logprob_chunk_tokens == 512 and changed.memory_plan is None
    assert (changed.ckpt_path, changed.resume) == (str(tmp_path / "ckpt"), True)
    assert changed.answer_format.name == "plain" and changed.answer_format.explicit
    assert (default.cpu_dtype, changed.cpu_dtype) == ("auto", "fp32")
    baseline = [*BASE, "--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2"]
    options, _ = train.parse(baseline)
    assert (options.method, options.params) == ("rloo_lp", {"alpha": 0.2})


def test_the_driver_fills_c_where_the_generation_budget_is_unset():
    argv = [a for a in BASE if a not in ("--rollout.max_new_tokens", "512")]
    assert train.parse(argv)[0].drpo.max_len == 1024  # --data.max_len
    assert train.parse(BASE)[0].drpo.max_len == 512  # --rollout.max_new_tokens


def test_the_options_are_frozen_and_survive_pickling(tmp_path):
    options, _ = train.parse(changed_run(tmp_path))
    with pytest.raises(FrozenInstanceError):
        options.max_steps = 8  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(options)) == options  # as Ray ships them to the actors


def test_the_checkpoint_keeps_the_drpo_settings_as_before():
    """What a checkpoint stores of the run (``policy_actors.DRPO_STATE``) is the config's dict,
    with the same keys and values as before the options were typed."""
    drpo = train.parse([*BASE, "--drpo.lam", "0.2"])[0].drpo
    assert asdict(drpo) == asdict(DRPOConfig(lam=0.2, max_len=512))  # C resolved


def test_one_accessor_reads_flat_and_nested_flags():
    flat = argparse.Namespace(**{"rollout.batch_size": 4, "ds.zero_stage": 2})
    nested = SimpleNamespace(
        rollout=SimpleNamespace(batch_size=4), ds=SimpleNamespace(zero_stage=2)
    )
    for args in (flat, nested):
        assert (flag(args, "rollout.batch_size"), flag(args, "ds.zero_stage")) == (4, 2)
        with pytest.raises(AttributeError):
            flag(args, "rollout.no_such_flag")


def test_one_layout_from_the_entry_points_flags_and_the_actors():
    """The entry point's check, the driver's deal and the actor's plan build the same layout."""
    flat = train.build_parser().parse_args([*BASE, "--ds.ring_attn_size", "2"])
    layout = layout_from_args(flat)
    assert layout == Layout(
        world_size=1,  # 2 GPUs in one ring group
        n_samples_per_prompt=4,
        rollout_batch_size=4,
        train_batch_size=16,
        micro_batch_size=2,
    )
    assert layout_from_args(hierarchize(flat)) == layout
    assert layout_from_args(hierarchize(flat), world_size=2).world_size == 2
