"""Shared plumbing of the OpenRLHF reward plugins (``math_reward.py``, ``kk_reward.py``).

OpenRLHF 0.11.2 loads ``--reward.remote_url some_file.py`` with
``importlib.util.spec_from_file_location`` and calls ``reward_func(queries, prompts,
labels)`` through ``asyncio.to_thread`` with one sample at a time. ``queries`` are
``tokenizer.decode(prompt_ids + response_ids, skip_special_tokens=False)``. It expects a
dict with ``rewards`` and ``scores`` (tensors, one value per sample) and ``extra_logs``
(a dict of per-sample tensors). Every sample must carry the same ``extra_logs`` keys:
OpenRLHF concatenates them across samples and fails on ragged keys. If ``reward_func``
raises, OpenRLHF logs it at INFO level and the sample silently has no reward, which
breaks training later, so the plugins never raise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from drpo_openrlhf.rewards.answer_extraction import split_query, to_text


def as_list(values: object, n: int) -> list:
    """``values`` as a list of length ``n`` (padded with ``None``; non-sequences repeat)."""
    if values is None:
        return [None] * n
    if isinstance(values, (str, bytes)):
        return [values] * n
    try:
        out = list(values)  # type: ignore[call-overload]
    except TypeError:
        return [values] * n
    return (out + [None] * n)[:n]


def query_count(queries: object) -> tuple[list, int]:
    if queries is None:
        return [], 0
    if isinstance(queries, (str, bytes)):
        return [queries], 1
    try:
        queries = list(queries)  # type: ignore[call-overload]
    except TypeError:
        return [queries], 1
    return queries, len(queries)


def responses_from_queries(queries: Sequence, prompts: Sequence) -> tuple[list[str], list[bool]]:
    """Cut each response out of its query; also says whether the prompt was found."""
    responses, found = [], []
    for query, prompt in zip(queries, prompts, strict=True):
        response, ok = split_query(to_text(query) or "", to_text(prompt))
        responses.append(response)
        found.append(ok)
    return responses, found


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return default


def build_output(
    correct: Sequence[bool],
    reasons: Sequence[str],
    prefix: str,
    reason_names: Sequence[str],
    extra: dict[str, Sequence[float]] | None = None,
) -> dict:
    """OpenRLHF's reward dict: 0/1 ``rewards`` = ``scores`` and per-sample indicator
    ``extra_logs`` ``{prefix}/{reason}`` for every reason (logged means are rates)."""
    import torch

    values = [1.0 if c else 0.0 for c in correct]
    logs = {
        f"{prefix}/{name}": torch.tensor(
            [1.0 if r == name else 0.0 for r in reasons], dtype=torch.float32
        )
        for name in reason_names
    }
    for key, column in (extra or {}).items():
        logs[f"{prefix}/{key}"] = torch.tensor([float(v) for v in column], dtype=torch.float32)
    return {
        "rewards": torch.tensor(values, dtype=torch.float32),
        "scores": torch.tensor(values, dtype=torch.float32),
        "extra_logs": logs,
    }
