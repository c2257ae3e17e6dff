"""Each prompt's responses tagged with the weight versions their tokens were sampled by.

The trainer tells every vLLM engine the version of the weights it sends it (``tag_version``:
inside the sync, before generation can resume: ``sync_check.VerifiedSyncTrainer``). The
engine writes the version it held when a prompt's request came and when its responses went
into each response's ``extra_logs``, which OpenRLHF copies into ``experience.info``; the
driver reads them for the policy lag (``algo.policy_lag``) and the log-prob gap's check, then
takes them out (``pop_version_tags``): no metric for the actors to log.
"""

from __future__ import annotations

import ray

from drpo_openrlhf.algo.policy_lag import Versions
from drpo_openrlhf.sync.engine_tag import info_rows

FIRST_KEY, LAST_KEY = "drpo_version_first", "drpo_version_last"  # experience.info keys


class WeightVersionEngine:
    """Mixin of the vLLM engine actor: ``generate_responses`` tags each response with the
    engine's weight version (``set_weight_version``) at the request and at the return."""

    _weight_version: int | None = None

    async def set_weight_version(self, version: int) -> int:
        self._weight_version = version
        return version

    async def generate_responses(self, *args, **kwargs):
        first = self._weight_version
        if first is None:
            raise RuntimeError("this vLLM engine was not told its weight version (tag_version)")
        outputs = await super().generate_responses(*args, **kwargs)
        tags = {FIRST_KEY: first, LAST_KEY: self._weight_version}
        for output in outputs:
            output["extra_logs"] = {**(output.get("extra_logs") or {}), **tags}
        return outputs


def tag_version(engines: list | None, version: int) -> None:
    """Tell every engine that it holds weight version ``version`` from now on."""
    ray.get([engine.set_weight_version.remote(version) for engine in engines or []])


def response_versions(experience) -> list[Versions]:
    """The ``(first, last)`` weight versions of each row of an experience batch."""
    if FIRST_KEY not in experience.info or LAST_KEY not in experience.info:
        raise KeyError(
            f"experience.info has no {FIRST_KEY!r}/{LAST_KEY!r}: the rollout came from an "
            "engine without WeightVersionEngine"
        )
    first, last = info_rows(experience.info[FIRST_KEY]), info_rows(experience.info[LAST_KEY])
    return list(zip(first, last, strict=True))


def pop_version_tags(experiences: list) -> None:
    for experience in experiences:
        experience.info.pop(FIRST_KEY, None)
        experience.info.pop(LAST_KEY, None)
