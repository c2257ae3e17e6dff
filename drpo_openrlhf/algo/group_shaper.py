"""Batch-level reward shaping with the state some baselines carry across steps.

HAPO rewards a response against the shortest correct length seen for its prompt at earlier
steps, so that history must live as long as the run (and survive checkpoint/resume); LASER-D
chooses its target from per-difficulty targets that the trainer refreshes from monitoring
rollouts. ``GroupRewardShaper`` holds both and applies ``shape_rewards`` group by group.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

from drpo_openrlhf.algo.baseline_rewards import (
    check_bucket_targets,
    laser_d_target_length,
    resolve_hparams,
    shape_rewards,
)


class GroupRewardShaper:
    """Shapes a flat batch whose consecutive runs of ``n_samples_per_prompt`` are groups.

    ``method`` and ``hparams`` are those of ``shape_rewards``, except that HAPO's ``h`` is
    tracked here (per prompt key: the shortest correct length seen so far), and that
    ``laser_d`` takes either a fixed ``target_length`` (LASER) or ``bucket_targets``, a
    mapping ``low``/``medium``/``high`` -> target length chosen per group by its accuracy
    (LASER-D; refresh it with ``set_bucket_targets``).
    """

    def __init__(self, method: str, n_samples_per_prompt: int, **hparams: object) -> None:
        if isinstance(n_samples_per_prompt, bool) or not (
            isinstance(n_samples_per_prompt, int) and n_samples_per_prompt >= 1
        ):
            raise ValueError(
                f"n_samples_per_prompt must be an int >= 1, not {n_samples_per_prompt}"
            )
        self.method = method
        self.n_samples_per_prompt = n_samples_per_prompt
        self._bucket_targets: dict[str, float] | None = None
        per_group: tuple[str, ...] = ()
        if method == "hapo":
            per_group = ("h",)
        elif method == "laser_d" and "bucket_targets" in hparams:
            hparams = dict(hparams)
            self.set_bucket_targets(check_bucket_targets(hparams.pop("bucket_targets")))
            per_group = ("target_length",)
        self._hparams = resolve_hparams(method, hparams, per_group)
        self._history: dict[str, float] = {}

    def set_bucket_targets(self, bucket_targets: Mapping[str, float]) -> None:
        """New LASER-D per-difficulty targets (e.g. from ``laser_d_bucket_targets``)."""
        if self.method != "laser_d":
            raise ValueError(f"bucket targets are a laser_d setting, not one of {self.method}")
        check_bucket_targets(bucket_targets)
        self._bucket_targets = {k: float(v) for k, v in bucket_targets.items()}

    def shape(
        self, prompt_keys: Sequence[str], lengths: Iterable[float], correct: Iterable[object]
    ) -> list[float]:
        """Shaped rewards of a flat batch, in batch order.

        Every group is rewarded against the HAPO history as it stood before this call, then
        the history takes the minimum correct length of each prompt's groups: HAPO's order
        (reward with ``h`` from earlier steps, then update), which also makes the result
        independent of the order of groups within the batch.
        """
        n = self.n_samples_per_prompt
        keys = list(prompt_keys)
        lens = list(lengths.tolist() if hasattr(lengths, "tolist") else lengths)
        flags = list(correct.tolist() if hasattr(correct, "tolist") else correct)
        if not len(keys) == len(lens) == len(flags):
            raise ValueError(
                f"{len(keys)} prompt keys, {len(lens)} lengths, {len(flags)} correctness flags"
            )
        if len(keys) % n:
            raise ValueError(f"batch of {len(keys)} responses is not made of groups of {n}")
        rewards: list[float] = []
        shortest: dict[str, float] = {}
        for start in range(0, len(keys), n):
            key = keys[start]
            group_keys = keys[start : start + n]
            if any(k != key for k in group_keys):
                raise ValueError(
                    f"responses {start}..{start + n - 1} should be one prompt's group of {n} "
                    f"but have prompt keys {sorted(set(map(repr, group_keys)))}"
                )
            if not isinstance(key, str):
                raise ValueError(f"prompt keys must be str (JSON object keys), got {key!r}")
            g_lens, g_flags = lens[start : start + n], flags[start : start + n]
            rewards += shape_rewards(
                self.method, g_lens, g_flags, **self._group_hparams(key, g_flags)
            )
            if self.method == "hapo":
                for length, ok in zip(g_lens, g_flags, strict=True):
                    if ok and float(length) > 0:  # h = 0 would define no ratio |o| / h
                        shortest[key] = min(shortest.get(key, math.inf), float(length))
        for key, length in shortest.items():
            self._history[key] = min(self._history.get(key, math.inf), length)
        return rewards

    def _group_hparams(self, key: str, flags: list[object]) -> dict[str, object]:
        if self.method == "hapo":
            return {**self._hparams, "h": self._history.get(key)}
        if self._bucket_targets is not None:
            return {
                **self._hparams,
                "target_length": laser_d_target_length(flags, self._bucket_targets),
            }
        return self._hparams

    def state_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable state: the HAPO history and the LASER-D bucket targets."""
        return {
            "method": self.method,
            "history": dict(self._history),
            "bucket_targets": None if self._bucket_targets is None else dict(self._bucket_targets),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a ``state_dict`` (also after a JSON round trip) of a shaper of this method."""
        if state.get("method") != self.method:
            raise ValueError(
                f"state of method {state.get('method')!r} given to a {self.method} shaper"
            )
        history = state.get("history")
        if not isinstance(history, Mapping) or not all(
            isinstance(k, str)
            and isinstance(v, numbers.Real)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and float(v) > 0
            for k, v in history.items()
        ):
            raise ValueError("history must map prompt keys (str) to lengths (finite numbers > 0)")
        bucket_targets = state.get("bucket_targets")
        if bucket_targets is not None:
            self.set_bucket_targets(check_bucket_targets(bucket_targets))
        self._history = {k: float(v) for k, v in history.items()}
