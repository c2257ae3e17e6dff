"""Evaluating one model on prepared datasets: prompts, cached generation, grading, metrics."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from drpo_openrlhf.eval.cache import GenerationCache, model_fingerprint, prompt_digest
from drpo_openrlhf.eval.generation import GenerationBackend, Sample, SamplingSettings
from drpo_openrlhf.eval.metrics import GradedSample, average_metrics, dataset_metrics
from drpo_openrlhf.eval.problems import Problem
from drpo_openrlhf.rewards.preference import count_reflections, restated_answers

SCHEMA_VERSION = 1
ROLES = ("run", "reference", "base")
DEFAULT_GRADER = "drpo_openrlhf.rewards.math_reward:grade_responses"


class GradeOutcome(Protocol):
    correct: bool
    reason: str


Grader = Callable[[Sequence[str], Sequence[str]], Sequence[GradeOutcome]]


def load_grader(spec: str = DEFAULT_GRADER, **kwargs: Any) -> Grader:
    """``"module:function"`` with ``kwargs`` bound, e.g. ``require_think_end=False``."""
    module_name, _, function_name = spec.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return partial(function, **kwargs) if kwargs else function


@dataclass(frozen=True)
class RunLabel:
    """How a result is named and placed in plots and AES tables.

    ``method`` groups runs into one trade-off curve; ``param`` is the value of its
    length/efficiency knob (``param_name``, e.g. lambda) for this run. ``role`` is ``run``,
    ``reference`` (the method without length penalty: the AES reference and the square
    marker) or ``base`` (the model before fine-tuning: a horizontal line).
    """

    name: str
    method: str | None = None
    param: str | None = None
    param_name: str | None = None
    role: str = "run"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The model's chat template on a single user turn, with the generation prompt."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    # The template already wrote any BOS token; do not add a second one.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Evaluator:
    """Evaluates models with one protocol (sampling, grader, backend) and one cache.

    ``backend_factory`` is called at most once per model, and only if some prompt is not in
    the cache yet: a fully cached evaluation never loads the model for generation.
    ``backend_key`` names what about the backend can change the samples (backend, dtype);
    it is part of the cache key. ``grader_info`` is recorded in the results.
    """

    sampling: SamplingSettings
    grader: Grader
    backend_factory: Callable[[str], GenerationBackend]
    cache_dir: Path
    backend_key: Mapping[str, Any] = field(default_factory=dict)
    grader_info: Mapping[str, Any] = field(default_factory=dict)
    ks: Sequence[int] = ()
    chunk_size: int = 256
    grade_batch_size: int = 512
    progress: bool = True

    def __post_init__(self) -> None:
        bad = [k for k in self.ks if not 1 <= k <= self.sampling.n]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= n={self.sampling.n}, got {bad}")

    def settings(self) -> dict[str, Any]:
        return {
            **asdict(self.sampling),
            **self.backend_key,
            "ks": sorted({1, *self.ks}),
            "grader": dict(self.grader_info),
        }

    def evaluate(
        self, model_path: str, datasets: Mapping[str, Sequence[Problem]], label: RunLabel
    ) -> dict[str, Any]:
        """Generates (or reads from the cache), grades, and returns the result document."""
        samples = self.generate(model_path, datasets)
        per_dataset = {
            name: dataset_metrics(self.grade(name, problems, samples[name]), self.ks)
            for name, problems in datasets.items()
        }
        return {
            "schema_version": SCHEMA_VERSION,
            **asdict(label),
            "model": model_path,
            "settings": self.settings(),
            "datasets": per_dataset,
            "average": average_metrics(per_dataset),
        }

    def generate(
        self, model_path: str, datasets: Mapping[str, Sequence[Problem]]
    ) -> dict[str, list[list[Sample]]]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        key = {
            "model": model_fingerprint(model_path),
            **asdict(self.sampling),
            **self.backend_key,
        }
        backend: GenerationBackend | None = None
        results = {}
        try:
            for name, problems in datasets.items():
                prompt_ids = [encode_prompt(tokenizer, p.prompt) for p in problems]
                digests = [prompt_digest(ids) for ids in prompt_ids]
                cache = GenerationCache(self.cache_dir, model_path, name, key)
                done = {
                    i: s
                    for i, (digest, s) in cache.load().items()
                    if i < len(problems) and digest == digests[i]
                }
                pending = [i for i in range(len(problems)) if i not in done]
                with tqdm(
                    total=len(problems),
                    initial=len(done),
                    desc=f"generate {name}",
                    unit="prompt",
                    disable=not self.progress,
                ) as bar:
                    for start in range(0, len(pending), self.chunk_size):
                        chunk = pending[start : start + self.chunk_size]
                        if backend is None:
                            backend = self.backend_factory(model_path)
                        generated = backend.generate(
                            [prompt_ids[i] for i in chunk],
                            self.sampling,
                            self.sampling.seed + chunk[0],
                        )
                        if len(generated) != len(chunk) or any(
                            len(g) != self.sampling.n for g in generated
                        ):
                            raise RuntimeError("backend returned the wrong number of samples")
                        cache.append(
                            [(i, digests[i], g) for i, g in zip(chunk, generated, strict=True)]
                        )
                        done.update(zip(chunk, generated, strict=True))
                        bar.update(len(chunk))
                results[name] = [done[i] for i in range(len(problems))]
        finally:
            if backend is not None:
                backend.close()
        return results

    def grade(
        self, name: str, problems: Sequence[Problem], samples: Sequence[Sequence[Sample]]
    ) -> list[list[GradedSample]]:
        """Grades every response against its problem's label, in batches (progress bar)."""
        flat = [(s, p.label) for p, group in zip(problems, samples, strict=True) for s in group]
        outcomes: list[GradeOutcome] = []
        with tqdm(
            total=len(flat), desc=f"grade {name}", unit="response", disable=not self.progress
        ) as bar:
            for start in range(0, len(flat), self.grade_batch_size):
                batch = flat[start : start + self.grade_batch_size]
                batch_outcomes = self.grader([s.text for s, _ in batch], [lab for _, lab in batch])
                if len(batch_outcomes) != len(batch):
                    raise RuntimeError("grader returned the wrong number of results")
                outcomes.extend(batch_outcomes)
                bar.update(len(batch))
        graded = [
            GradedSample(
                s.num_tokens,
                s.truncated,
                bool(o.correct),
                str(o.reason),
                count_reflections(s.text),
                restated_answers(s.text),
            )
            for (s, _), o in zip(flat, outcomes, strict=True)
        ]
        starts = [0]
        for group in samples:
            starts.append(starts[-1] + len(group))
        return [graded[a:b] for a, b in pairwise(starts)]
