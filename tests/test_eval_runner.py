"""Whole evaluations: the tiny model with the HF backend, and the generation cache."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from drpo_openrlhf.eval.generation import HFBackend, Sample, SamplingSettings
from drpo_openrlhf.eval.problems import Problem, load_problems
from drpo_openrlhf.eval.runner import Evaluator, RunLabel, encode_prompt
from drpo_openrlhf.models.tiny import build_tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "eval" / "problems.jsonl"
LABEL = RunLabel(name="tiny", method="DRPO", param="0.1", param_name="lambda")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def datasets() -> dict[str, list[Problem]]:
    return load_problems([FIXTURE])


def boxed_grader(responses: Sequence[str], labels: Sequence[str]) -> list[SimpleNamespace]:
    """Correct iff the last \\boxed{...} equals the label verbatim."""
    outcomes = []
    for response, label in zip(responses, labels, strict=True):
        found = re.findall(r"\\boxed\{([^{}]*)\}", response)
        reason = "no_box" if not found else ("match" if found[-1] == label else "mismatch")
        outcomes.append(SimpleNamespace(correct=reason == "match", reason=reason))
    return outcomes


def digit_grader(responses: Sequence[str], labels: Sequence[str]) -> list[SimpleNamespace]:
    """For random tiny-model text: "correct" iff the response contains a digit."""
    return [SimpleNamespace(correct=any(c.isdigit() for c in r), reason="digit") for r in responses]


class ScriptedBackend:
    """Sample j of every prompt answers j with 10 * (j + 1) tokens; the last one truncated."""

    def __init__(self) -> None:
        self.prompts_seen: list[list[int]] = []
        self.closed = False

    def generate(self, prompt_ids, sampling: SamplingSettings, seed: int) -> list[list[Sample]]:
        self.prompts_seen.extend(list(p) for p in prompt_ids)
        return [
            [
                Sample(f"<think>ok</think> \\boxed{{{j}}}", 10 * (j + 1), j == sampling.n - 1)
                for j in range(sampling.n)
            ]
            for _ in prompt_ids
        ]

    def close(self) -> None:
        self.closed = True


def no_backend(model_path: str):
    raise AssertionError("the backend must not be created when everything is cached")


def make_evaluator(cache_dir: Path, backend_factory, **overrides) -> Evaluator:
    options = {
        "sampling": SamplingSettings(n=8, max_new_tokens=64),
        "grader": boxed_grader,
        "backend_factory": backend_factory,
        "cache_dir": cache_dir,
        "backend_key": {"backend": "scripted"},
        "ks": [4, 8],
        "chunk_size": 2,
        "progress": False,
    }
    return Evaluator(**{**options, **overrides})


def test_tiny_model_end_to_end_with_hf_backend(tiny: str, datasets, tmp_path: Path) -> None:
    seen: list[list[int]] = []

    def factory(path: str) -> HFBackend:
        backend = HFBackend(path, batch_size=4)
        generate = backend.generate

        def spy(prompt_ids, sampling, seed):
            seen.extend(list(p) for p in prompt_ids)
            return generate(prompt_ids, sampling, seed)

        backend.generate = spy
        return backend

    sampling = SamplingSettings(n=3, max_new_tokens=8, seed=1)
    evaluator = make_evaluator(
        tmp_path, factory, sampling=sampling, grader=digit_grader, ks=[2, 3], chunk_size=8
    )
    doc = evaluator.evaluate(tiny, datasets, LABEL)

    assert list(doc["datasets"]) == ["arith_easy", "fractions"]
    easy, fractions = doc["datasets"]["arith_easy"], doc["datasets"]["fractions"]
    assert (easy["num_problems"], easy["num_samples"]) == (4, 12)
    assert (fractions["num_problems"], fractions["num_samples"]) == (2, 6)
    # The backend received each problem once, as the chat template of a single user turn.
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert len(seen) == 6
    assert tokenizer.decode(seen[0]) == (
        f"<|im_start|>user\n{datasets['arith_easy'][0].prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
    # Metrics agree with the cached generations re-graded by hand.
    cache_files = sorted(tmp_path.rglob("*.jsonl"))
    assert [f.name.split("-")[0] for f in cache_files] == ["arith_easy", "fractions"]
    rows = [json.loads(line) for line in cache_files[0].read_text().splitlines()[1:]]
    texts = [s["text"] for row in sorted(rows, key=lambda r: r["index"]) for s in row["samples"]]
    correct = [o.correct for o in digit_grader(texts, [""] * len(texts))]
    assert easy["pass@1"] == pytest.approx(sum(correct) / 12)
    lengths = [s["num_tokens"] for row in rows for s in row["samples"]]
    assert easy["mean_length"] == pytest.approx(sum(lengths) / 12)
    assert all(1 <= n <= 8 for n in lengths)
    truncated = [s["truncated"] for row in rows for s in row["samples"]]
    assert easy["truncation_rate"] == pytest.approx(sum(truncated) / 12)
    assert all(n == 8 for n, t in zip(lengths, truncated, strict=True) if t)
    assert doc["average"]["pass@1"] == pytest.approx((easy["pass@1"] + fractions["pass@1"]) / 2)
    assert 0 <= easy["pass@1"] <= easy["pass@2"] <= easy["pass@3"] <= 1


def test_scripted_evaluation_metrics(tiny: str, datasets, tmp_path: Path) -> None:
    backend = ScriptedBackend()
    doc = make_evaluator(tmp_path, lambda path: backend).evaluate(tiny, datasets, LABEL)
    assert backend.closed
    easy = doc["datasets"]["arith_easy"]
    # Labels 5, 42, 7, 8 against answers 0..7: one sample right for 5 and 7, none otherwise.
    assert easy["pass@1"] == pytest.approx(2 / 32)
    assert easy["pass@8"] == pytest.approx(2 / 4)
    assert easy["pass@4"] == pytest.approx(2 * (4 / 8) / 4)
    assert easy["mean_length_correct"] == pytest.approx((60 + 80) / 2)
    assert easy["truncation_rate"] == pytest.approx(1 / 8)
    assert easy["reasons"] == {"match": 2, "mismatch": 30}
    assert doc["datasets"]["fractions"]["pass@1"] == 0
    assert doc["settings"]["ks"] == [1, 4, 8] and doc["settings"]["backend"] == "scripted"
    assert (doc["method"], doc["param"], doc["role"]) == ("DRPO", "0.1", "run")


def test_resume_from_cache_does_not_regenerate(tiny: str, datasets, tmp_path: Path) -> None:
    first = make_evaluator(tmp_path, lambda path: ScriptedBackend()).evaluate(tiny, datasets, LABEL)
    second = make_evaluator(tmp_path, no_backend).evaluate(tiny, datasets, LABEL)
    assert second == first


class FailingAfter(ScriptedBackend):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls_left = calls

    def generate(self, prompt_ids, sampling, seed):
        if self.calls_left == 0:
            raise KeyboardInterrupt
        self.calls_left -= 1
        return super().generate(prompt_ids, sampling, seed)


def test_interrupted_evaluation_resumes_where_it_stopped(tiny, datasets, tmp_path: Path) -> None:
    interrupted = FailingAfter(calls=1)  # chunk_size=2: two prompts of arith_easy are saved
    with pytest.raises(KeyboardInterrupt):
        make_evaluator(tmp_path, lambda path: interrupted).evaluate(tiny, datasets, LABEL)
    assert interrupted.closed

    resumed = ScriptedBackend()
    doc = make_evaluator(tmp_path, lambda path: resumed).evaluate(tiny, datasets, LABEL)
    assert len(resumed.prompts_seen) == 6 - 2
    fresh = make_evaluator(tmp_path / "fresh", lambda path: ScriptedBackend())
    assert doc == fresh.evaluate(tiny, datasets, LABEL)


def test_cut_off_line_and_changed_prompt_are_regenerated(tiny, datasets, tmp_path: Path) -> None:
    make_evaluator(tmp_path, lambda path: ScriptedBackend()).evaluate(tiny, datasets, LABEL)
    cache_file = next(tmp_path.rglob("fractions-*.jsonl"))
    lines = cache_file.read_text().splitlines()
    cache_file.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # killed mid-write

    edited = dict(datasets)
    edited["arith_easy"] = [Problem("What is 2 + 2?", "4"), *datasets["arith_easy"][1:]]
    backend = ScriptedBackend()
    make_evaluator(tmp_path, lambda path: backend).evaluate(tiny, edited, LABEL)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    decoded = [tokenizer.decode(p) for p in backend.prompts_seen]
    assert len(decoded) == 2
    assert "What is 2 + 2?" in decoded[0]
    assert datasets["fractions"][-1].prompt in decoded[1]
    assert all(json.loads(line) for line in cache_file.read_text().splitlines())


def test_other_settings_use_another_cache(tiny: str, datasets, tmp_path: Path) -> None:
    make_evaluator(tmp_path, lambda path: ScriptedBackend()).evaluate(tiny, datasets, LABEL)
    backend = ScriptedBackend()
    hotter = SamplingSettings(n=8, max_new_tokens=64, temperature=1.0)
    make_evaluator(tmp_path, lambda path: backend, sampling=hotter).evaluate(tiny, datasets, LABEL)
    assert len(backend.prompts_seen) == 6
    assert len(list(tmp_path.rglob("*.jsonl"))) == 4


def test_grading_in_batches(tiny: str, datasets, tmp_path: Path) -> None:
    sizes: list[int] = []

    def grader(responses, labels):
        sizes.append(len(responses))
        return boxed_grader(responses, labels)

    evaluator = make_evaluator(
        tmp_path, lambda path: ScriptedBackend(), grader=grader, grade_batch_size=10
    )
    evaluator.evaluate(tiny, datasets, LABEL)
    assert sizes == [10, 10, 10, 2, 10, 6]


def test_invalid_configuration(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_evaluator(tmp_path, no_backend, ks=[16])  # k > n
    with pytest.raises(ValueError):
        RunLabel(name="x", role="baseline")
    with pytest.raises(ValueError):
        SamplingSettings(top_p=0)


def test_load_problems(tmp_path: Path) -> None:
    datasets = load_problems([FIXTURE])
    assert {k: len(v) for k, v in datasets.items()} == {"arith_easy": 4, "fractions": 2}
    assert datasets["fractions"][0].label == "\\frac{3}{4}"

    extra = tmp_path / "gsm_extra.jsonl"
    extra.write_text(
        json.dumps({"prompt": "p1", "label": 3})
        + "\n\n"
        + json.dumps({"prompt": "p2", "label": "x", "datasource": "fractions"})
        + "\n"
    )
    merged = load_problems([FIXTURE, extra], limit=3)
    assert {k: len(v) for k, v in merged.items()} == {
        "arith_easy": 3,
        "fractions": 3,
        "gsm_extra": 1,
    }
    assert merged["gsm_extra"] == [Problem("p1", "3")]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="label"):
        load_problems([bad])
    bad.write_text(json.dumps({"prompt": "p", "label": "1", "datasource": "average"}) + "\n")
    with pytest.raises(ValueError, match="reserved"):
        load_problems([bad])


class AnswerBackend(ScriptedBackend):
    """For each prompt, in order: an equivalent answer, a wrong one, one without </think>,
    one without a box."""

    def __init__(self, equivalents: list[str]) -> None:
        super().__init__()
        self.equivalents = iter(equivalents)

    def generate(self, prompt_ids, sampling, seed):
        self.prompts_seen.extend(prompt_ids)
        return [
            [
                Sample(f"<think>so</think> The answer is \\boxed{{{answer}}}.", 12, False),
                Sample("<think>so</think> \\boxed{1000}", 8, False),
                Sample(f"\\boxed{{{answer}}}", 5, False),
                Sample("<think>so</think> I do not know", 7, False),
            ]
            for answer in (next(self.equivalents) for _ in prompt_ids)
        ]


@pytest.mark.parametrize("require_think_end", [True, False])
def test_real_math_grader(tiny, datasets, tmp_path: Path, require_think_end: bool) -> None:
    from drpo_openrlhf.eval.runner import load_grader

    # Labels: 5, 42, 7, 8 (arith_easy) and \frac{3}{4}, \frac{5}{6} (fractions).
    equivalents = ["5.0", "42", "7", "8", "0.75", "\\dfrac{5}{6}"]
    evaluator = make_evaluator(
        tmp_path,
        lambda path: AnswerBackend(equivalents),
        sampling=SamplingSettings(n=4, max_new_tokens=64),
        grader=load_grader(require_think_end=require_think_end),
        ks=[4],
        chunk_size=8,
    )
    doc = evaluator.evaluate(tiny, datasets, LABEL)
    for name in ("arith_easy", "fractions"):
        metrics = doc["datasets"][name]
        problems = metrics["num_problems"]
        if require_think_end:
            assert metrics["pass@1"] == pytest.approx(0.25)
            assert metrics["reasons"] == {
                "no_boxed": problems, "no_think_end": problems, "ok": problems, "wrong": problems
            }  # fmt: skip
            assert metrics["mean_length_correct"] == pytest.approx(12)
        else:
            assert metrics["pass@1"] == pytest.approx(0.5)
            assert metrics["mean_length_correct"] == pytest.approx((12 + 5) / 2)
        assert metrics["pass@4"] == 1.0


def test_hf_backend_sampling_details(tiny: str) -> None:
    backend = HFBackend(tiny, batch_size=2)
    tokenizer = backend.tokenizer
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    words = tokenizer("<think>1 + 2</think>")["input_ids"]
    stopped = backend._to_sample([*words, eos, pad, pad], max_new_tokens=len(words) + 3)
    assert stopped == Sample("<think>1 + 2</think>", len(words) + 1, False)
    cut = backend._to_sample(words, max_new_tokens=len(words))
    assert cut == Sample("<think>1 + 2</think>", len(words), True)

    prompts = [encode_prompt(tokenizer, "What is 2 + 3?"), encode_prompt(tokenizer, "Hi")]
    sampling = SamplingSettings(n=3, max_new_tokens=6)
    first = backend.generate(prompts, sampling, seed=7)
    assert backend.generate(prompts, sampling, seed=7) == first
    assert backend.generate(prompts, sampling, seed=8) != first
    assert [len(group) for group in first] == [3, 3]
    greedy = backend.generate(prompts, SamplingSettings(n=3, temperature=0, max_new_tokens=6), 0)
    assert all(group == [group[0]] * 3 for group in greedy)
    # Batching does not change greedy answers (left padding is masked).
    single = HFBackend(tiny, batch_size=1)
    assert single.generate(prompts, SamplingSettings(n=1, temperature=0, max_new_tokens=6), 0) == [
        [g[0]] for g in greedy
    ]
