"""The engines' settings against the actor's (``sync/engine_settings.py``): what each side
reads, and every difference named with both values, in one engine of two and in the only one.
The real CPU engines' reports are compared in the pipeline runs (``test_weight_sync_guard.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drpo_openrlhf.sync import engine_settings
from drpo_openrlhf.sync.engine_settings import (
    AGAINST_ACTOR,
    AMONG_ENGINES,
    EngineSettingsError,
    actor_settings,
    check,
    differences,
    rope_parameters,
)

MAX_LEN = 320


def tiny_llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    small = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(LlamaConfig(**small, **config)).to(torch.bfloat16)


def rotary(base: float) -> torch.nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when built
        return get_rope(8, 512, rope_parameters={"rope_theta": base, "rope_type": "default"})


def fake_worker(model_config: LlamaConfig, **overrides) -> SimpleNamespace:
    """A vLLM worker as ``engine_settings`` reads it: the model holds a real vLLM rotary
    module; the configs are plain objects with vLLM's attribute names."""
    base = rope_parameters(model_config)[0]
    model = torch.nn.Sequential(rotary(overrides.pop("base", base)))
    config = dict(dtype=torch.bfloat16, max_model_len=MAX_LEN, quantization=None)
    config.update((k, overrides.pop(k)) for k in list(overrides) if k in config)
    cache = SimpleNamespace(cache_dtype=overrides.pop("kv_cache_dtype", "auto"))
    # on a GPU the runner's ``model`` is a CUDA-graph wrapper, no Module; ``get_model`` unwraps
    wrapped = {"model": object(), "get_model": lambda self: model}
    runner = type(overrides.pop("runner", "CPUModelRunner"), (), wrapped)()
    assert not overrides, overrides
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=model_config, **config),
        cache_config=cache,
        model_runner=runner,
    )


def test_rope_parameters_read_both_transformers_layouts():
    v5 = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert rope_parameters(v5) == (5e5, {})
    v4 = SimpleNamespace(rope_theta=1e4, rope_scaling=None)
    assert rope_parameters(v4) == (1e4, {})
    scaled = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}
    assert rope_parameters(SimpleNamespace(rope_parameters=scaled)) == (
        5e5,
        {"rope_type": "llama3", "factor": 8.0},
    )
    assert rope_parameters(SimpleNamespace()) == (None, {})


def test_a_healthy_engine_runs_as_the_actor():
    """The tiny Llama on both sides: every compared setting agrees, and the line names them."""
    model = tiny_llama(rope_theta=10000.0)
    actor = actor_settings(model, MAX_LEN)
    engine = engine_settings.engine_settings(fake_worker(model.config))
    assert set(engine) == set(AGAINST_ACTOR) | set(AMONG_ENGINES)
    assert {k: engine[k] for k in AGAINST_ACTOR} == actor
    assert actor["dtype"] == "bfloat16" and actor["rope_theta"] == "10000.0"
    line = check(actor, [[engine], [dict(engine)]], "at start-up")
    assert line.startswith("engine settings at start-up: 2 engine(s) run as the actor: ")
    assert "dtype bfloat16" in line and "model_runner CPUModelRunner" in line


# one broken engine's overrides, the setting it breaks, its value and the actor's
BREAKS = [
    ({"dtype": torch.float16}, "dtype", "float16", "bfloat16"),
    ({"base": 40000.0}, "rope_theta", "40000.0", "10000.0"),
    ({"max_model_len": 256}, "max_model_len", "256", str(MAX_LEN)),
    ({"quantization": "fp8"}, "quantization", "fp8", "none"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype", "fp8_e5m2", "auto"),
]


@pytest.mark.parametrize(("overrides", "name", "ours", "theirs"), BREAKS)
@pytest.mark.parametrize("engines", [1, 2])
def test_each_setting_that_differs_is_named_with_both_values(
    overrides, name, ours, theirs, engines
):
    """One engine of two broken (the other not named), or the only engine."""
    model = tiny_llama(rope_theta=10000.0)
    actor = actor_settings(model, MAX_LEN)
    healthy = engine_settings.engine_settings(fake_worker(model.config))
    broken = engine_settings.engine_settings(fake_worker(model.config, **overrides))
    reports = [[broken]] if engines == 1 else [[healthy], [broken]]
    problems, notes = differences(actor, reports)
    who = f"engine {engines - 1} of {engines}"
    assert problems == [f"{who}: {name} {ours}, the actor's {theirs}"]
    assert notes == []
    with pytest.raises(EngineSettingsError) as raised:
        check(actor, reports, "at start-up")
    message = str(raised.value)
    assert f"  {who}: {name} {ours}, the actor's {theirs}\n" in message
    assert f"  {name}: {AGAINST_ACTOR[name]}" in message
    assert message.endswith(f"--drpo.allow_engine_difference {name} (docs/reliability.md).")
    allowed = check(actor, reports, "at start-up", allowed=[name])  # meant: a note, no stop
    assert f"\n  allowed: {who}: {name} {ours}, the actor's {theirs}" in allowed


def test_rope_scaling_in_one_config_is_named():
    model = tiny_llama(rope_theta=10000.0)
    other = LlamaConfig(**{**model.config.to_dict()})
    other.rope_parameters = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    engine = engine_settings.engine_settings(fake_worker(other))
    problems, _ = differences(actor_settings(model, MAX_LEN), [[engine]])
    assert problems == [
        "engine 0 of 1: rope_scaling {factor: 2.0, rope_type: linear}, the actor's none"
    ]


def test_engines_that_run_other_kernels_or_versions_are_named_against_engine_0():
    """Settings the actor does not share (its kernels are its own) are compared among the
    engines; every worker of a tensor-parallel engine is compared."""
    model = tiny_llama()
    actor = actor_settings(model, MAX_LEN)
    first = engine_settings.engine_settings(fake_worker(model.config))
    other = engine_settings.engine_settings(fake_worker(model.config, runner="GPUModelRunnerV2"))
    newer = {**first, "vllm": "0.30.0"}
    problems, _ = differences(actor, [[first, first], [first, other], [newer, newer]])
    assert problems == [
        "engine 1 of 3 (worker 1): model_runner GPUModelRunnerV2, engine 0's CPUModelRunner",
        "engine 2 of 3 (worker 0): vllm 0.30.0, engine 0's " + first["vllm"],
        "engine 2 of 3 (worker 1): vllm 0.30.0, engine 0's " + first["vllm"],
    ]


def test_engines_of_one_kind_run_the_same_kernels_on_any_node():
    """``kernel_kind``: the settings that pick an engine's kernels, of all its workers; the
    actor-side settings (the same on every engine once checked) and the node do not enter."""
    model = tiny_llama()
    first = engine_settings.engine_settings(fake_worker(model.config))
    v2 = engine_settings.engine_settings(fake_worker(model.config, runner="GPUModelRunnerV2"))
    a100 = {**first, "device": "NVIDIA A100-SXM4-80GB"}
    kind = engine_settings.kernel_kind
    assert kind([first, dict(first)]) == kind([first])
    assert kind([{**first, "max_model_len": "1"}]) == kind([first])
    assert len({kind([first]), kind([v2]), kind([a100]), kind([first, a100])}) == 4
    assert "NVIDIA A100-SXM4-80GB" in kind([a100])
    assert engine_settings.mixed_kinds([kind([first])] * 3) is None
    line = engine_settings.mixed_kinds([kind([first]), kind([a100]), kind([first])])
    assert line.startswith("the weight probe holds engines to each other within a kind")
    assert f"engines 0, 2 ({kind([first])}); engines 1 ({kind([a100])})" in line


def test_several_differences_are_all_named_in_one_stop():
    model = tiny_llama(rope_theta=10000.0)
    actor = actor_settings(model, MAX_LEN)
    broken = fake_worker(model.config, dtype=torch.float16, base=40000.0, max_model_len=64)
    with pytest.raises(EngineSettingsError) as raised:
        check(actor, [[engine_settings.engine_settings(broken)]], "at the resumed run's start")
    message = str(raised.value)
    assert "(at the resumed run's start)" in message
    for name in ("dtype", "rope_theta", "max_model_len"):
        assert f"engine 0 of 1: {name} " in message, name
    assert "--drpo.allow_engine_difference dtype,max_model_len,rope_theta" in message


def test_an_unreported_setting_is_a_difference():
    """An engine whose worker reports less (another package's extension) is not taken to agree."""
    model = tiny_llama()
    actor = actor_settings(model, MAX_LEN)
    engine = engine_settings.engine_settings(fake_worker(model.config))
    del engine["kv_cache_dtype"]
    problems, _ = differences(actor, [[engine]])
    assert problems == ["engine 0 of 1: kv_cache_dtype unreported, the actor's auto"]
