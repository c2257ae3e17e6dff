"""What every vLLM engine runs, compared exactly with what the actor runs, before the first
rollout and after every resume.

The digests prove that the engines hold the actor's weights; the weight probe and the rollout
log-prob gap are statistics, which cannot tell a small systematic difference from kernels'
noise (an fp16 engine beside a bf16 actor: 0.029 nats per token, seen only engine against
engine). The settings behind such differences are known exactly on both sides, so they are
read and compared, and each difference is named with both values and what sets it. A
difference that is meant (an fp8 KV cache) is allowed by name
(``--drpo.allow_engine_difference``); the probe and the gap stay the backstop for what no
setting shows.

The readers take vLLM's worker and the actor's model by duck typing, so this module imports
neither vLLM nor OpenRLHF.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

# Compared between every engine and the actor: setting -> what sets each side.
AGAINST_ACTOR: dict[str, str] = {
    "dtype": "the engines': bfloat16 on GPU (OpenRLHF's create_vllm_engines), --drpo.cpu_dtype "
    "on CPU; the actor's: --ds.param_dtype",
    "rope_theta": "the rotary base the engine computes with, against the actor's model config "
    "(another checkpoint or config on one side, a patched model)",
    "rope_scaling": "the rotary scaling in the model config each side loaded",
    "max_model_len": "the longest sequence the engine accepts, against the run's --data.max_len",
    "quantization": "the engine's weight quantization; the actor trains unquantized weights",
    "kv_cache_dtype": "the engine's KV-cache dtype (auto: the model's dtype)",
}
# Compared among the engines only (the actor runs other kernels by design).
AMONG_ENGINES: dict[str, str] = {
    "vllm": "vLLM's version on the engine's node",
    "torch": "torch's version on the engine's node",
    "device": "the engine's device model",
    "model_runner": "vLLM's model runner (V1 or V2, picked by vLLM per platform)",
    "attention_backend": "vLLM's attention kernels",
}
SETTINGS = (*AGAINST_ACTOR, *AMONG_ENGINES)
# Checked before launch from the flags (runtime/options.py): what the engines are asked to
# sample from, against the full softmax the actor scores.
SAMPLING = ("top_p",)
ALLOWABLE = (*SETTINGS, *SAMPLING)


class EngineSettingsError(RuntimeError):
    """An engine runs the model otherwise than the actor, or than another engine."""


def _value(value: Any) -> str:
    """A setting as compared and printed: exact text, ``none`` for unset."""
    if value is None:
        return "none"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Mapping):
        items = sorted((k, v) for k, v in value.items() if v is not None)
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in items) + "}" if items else "none"
    return str(value)


def rope_parameters(config: Any) -> tuple[Any, dict[str, Any]]:
    """``(rope_theta, scaling)`` of a Hugging Face model config, as transformers 5 writes it
    (``rope_parameters``) or 4 (``rope_theta``, ``rope_scaling``); the scaling without its
    theta, ``rope_type`` ``default`` counted as none."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(config, "rope_theta", None))
    params.update(getattr(config, "rope_scaling", None) or {})
    params.pop("rope_theta", None)
    if params.get("rope_type", params.get("type")) in ("default", None):
        params = {k: v for k, v in params.items() if k not in ("rope_type", "type")}
    return theta, params


def _rotary_bases(model: torch.nn.Module) -> str:
    """The base of every rotary embedding module the engine's model computes with (vLLM
    shares one among the layers): what a patched or misread base changes."""
    bases = sorted({float(m.base) for m in model.modules() if _is_rotary(m)})
    return ", ".join(repr(b) for b in bases) if bases else "none"


def _is_rotary(module: torch.nn.Module) -> bool:
    return any(cls.__name__ == "RotaryEmbeddingBase" for cls in type(module).__mro__)


def _attention_backends(model: torch.nn.Module) -> str:
    names = set()
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            names.add(str(backend.get_name()))
    return ", ".join(sorted(names)) or "none"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()})"


def engine_settings(worker: Any) -> dict[str, str]:
    """What one vLLM worker runs (its ``model_config``, ``cache_config`` and loaded model,
    unwrapped from a CUDA-graph wrapper by ``get_model``, which the CPU, V1 and V2 model
    runners all have)."""
    import vllm

    model_config, model = worker.model_config, worker.model_runner.get_model()
    _, scaling = rope_parameters(model_config.hf_config)
    return {
        "dtype": _value(model_config.dtype),
        "rope_theta": _rotary_bases(model),
        "rope_scaling": _value(scaling),
        "max_model_len": _value(model_config.max_model_len),
        "quantization": _value(model_config.quantization),
        "kv_cache_dtype": _value(worker.cache_config.cache_dtype),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": device_name(),
        "model_runner": type(worker.model_runner).__name__,
        "attention_backend": _attention_backends(model),
    }


def actor_settings(model: torch.nn.Module, max_len: int) -> dict[str, str]:
    """What the actor runs, for the settings compared against the engines: its parameters'
    dtype, its model config's rotary settings; ``max_len`` is the run's ``--data.max_len``,
    the context the engines are created with."""
    theta, scaling = rope_parameters(model.config)
    dtype = next(model.parameters()).dtype
    return {
        "dtype": _value(dtype),
        "rope_theta": _value(None if theta is None else float(theta)),
        "rope_scaling": _value(scaling),
        "max_model_len": _value(max_len),
        "quantization": "none",
        "kv_cache_dtype": "auto",
    }


def differences(
    actor: Mapping[str, str],
    engines: Sequence[Sequence[Mapping[str, str]]],
    allowed: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """``(problems, allowed_notes)``: one line per engine worker and setting that differs from
    the actor's (``AGAINST_ACTOR``) or from engine 0's first worker (``AMONG_ENGINES``),
    with both values; settings in ``allowed`` become notes instead."""
    allowed = set(allowed)
    problems: list[str] = []
    notes: list[str] = []
    reference = engines[0][0]
    count = len(engines)
    for i, workers in enumerate(engines):
        for w, settings in enumerate(workers):
            who = f"engine {i} of {count}" + (f" (worker {w})" if len(workers) > 1 else "")
            for name in SETTINGS:
                against, side = (
                    (actor, "the actor's") if name in AGAINST_ACTOR else (reference, "engine 0's")
                )
                if against is reference and i == 0 and w == 0:
                    continue
                ours, theirs = settings.get(name, "unreported"), against.get(name, "unreported")
                if ours == theirs:
                    continue
                line = f"{who}: {name} {ours}, {side} {theirs}"
                (notes if name in allowed else problems).append(line)
    return problems, notes


def kernel_kind(workers: Sequence[Mapping[str, str]]) -> str:
    """What decides the kernels an engine computes with: its workers' ``AMONG_ENGINES``
    settings (device model, vLLM and torch builds, model runner, attention backend). Engines
    of one kind score a text bit for bit alike, on any node (docs/reliability.md)."""
    return "; ".join(sorted({", ".join(w[name] for name in AMONG_ENGINES) for w in workers}))


def mixed_kinds(kinds: Sequence[str]) -> str | None:
    """The line that names each kind's engines when there is more than one kind (a mixed
    job: a device or build difference allowed), for the weight probe's comparisons."""
    if len(set(kinds)) < 2:
        return None
    groups = {kind: [str(i) for i, k in enumerate(kinds) if k == kind] for kind in kinds}
    listed = "; ".join(f"engines {', '.join(g)} ({kind})" for kind, g in groups.items())
    return (
        "the weight probe holds engines to each other within a kind of kernels only, and each "
        f"to the actor: {listed}"
    )


def check(
    actor: Mapping[str, str],
    engines: Sequence[Sequence[Mapping[str, str]]],
    when: str,
    allowed: Iterable[str] = (),
) -> str:
    """Raise ``EngineSettingsError`` naming every difference that is not ``allowed``; else
    the one line that says what the engines and the actor agree on (and what was allowed)."""
    problems, notes = differences(actor, engines, allowed)
    if problems:
        named = sorted({line.split(": ", 1)[1].split(" ", 1)[0] for line in problems})
        causes = "\n  ".join(
            f"{name}: {AGAINST_ACTOR.get(name) or AMONG_ENGINES[name]}" for name in named
        )
        raise EngineSettingsError(
            f"the vLLM engines do not run the model as the actor does ({when}):\n  "
            + "\n  ".join(problems)
            + f"\nWhat sets each:\n  {causes}\nRollouts would come from another policy than "
            "the one DRPO scores. A difference that is meant: --drpo.allow_engine_difference "
            + ",".join(named)
            + " (docs/reliability.md)."
        )
    agreed = ", ".join(f"{name} {actor[name]}" for name in AGAINST_ACTOR if name in actor)
    first = engines[0][0]
    kernels = ", ".join(f"{name} {first.get(name, 'unreported')}" for name in AMONG_ENGINES)
    line = f"engine settings {when}: {len(engines)} engine(s) run as the actor: {agreed}; {kernels}"
    return line + "".join(f"\n  allowed: {note}" for note in notes)
