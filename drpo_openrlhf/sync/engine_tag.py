"""Each response tagged with the index of the vLLM engine that generated it.

OpenRLHF's samples generator sends each prompt to the least loaded engine
(``samples_generator.py: SamplesGenerator._dispatch_prompts_to_vllm``) and keeps no record of
which. The rollout log-prob gap is checked per engine (``sync.logprob_gap``), so every engine
is told its index in the driver's engine list once (``tag_engines``) and writes it into each
response's ``extra_logs``, which OpenRLHF copies into ``experience.info``. The driver takes it
out again after the check (``pop_engine_tags``): it is no metric for the actors to log.
"""

from __future__ import annotations

import ray
import torch

ENGINE_KEY = "drpo_engine"  # experience.info key: the index of the engine that generated it


class EngineTaggingEngine:
    """Mixin of the vLLM engine actor: ``generate_responses`` adds the engine's index (set by
    ``set_engine_index``) to each response's ``extra_logs``."""

    _engine_index: int | None = None

    async def set_engine_index(self, index: int) -> int:
        self._engine_index = index
        return index

    async def generate_responses(self, *args, **kwargs):
        if self._engine_index is None:
            raise RuntimeError("this vLLM engine was not told its index (tag_engines)")
        outputs = await super().generate_responses(*args, **kwargs)
        for output in outputs:
            output["extra_logs"] = {
                **(output.get("extra_logs") or {}),
                ENGINE_KEY: self._engine_index,
            }
        return outputs


def tag_engines(engines: list | None) -> None:
    """Tell every engine its index in ``engines`` (the driver's list, OpenRLHF's dispatch
    order)."""
    ray.get([engine.set_engine_index.remote(i) for i, engine in enumerate(engines or [])])


def info_rows(value) -> list[int]:
    """A per-row ``info`` value as ints: OpenRLHF and the deal leave it as a ``(B,)`` or
    ``(B, 1)`` tensor or a list of one-element tensors."""
    if isinstance(value, list):
        return [int(torch.as_tensor(v).flatten()[0]) for v in value]
    return [int(v) for v in torch.as_tensor(value).reshape(len(value), -1)[:, 0]]


def engine_tags(experience) -> list[int]:
    """The engine index of each row of an experience batch."""
    if ENGINE_KEY not in experience.info:
        raise KeyError(
            f"experience.info has no {ENGINE_KEY!r}: the rollout came from an engine without "
            "EngineTaggingEngine"
        )
    return info_rows(experience.info[ENGINE_KEY])


def pop_engine_tags(experiences: list) -> None:
    for experience in experiences:
        experience.info.pop(ENGINE_KEY, None)
