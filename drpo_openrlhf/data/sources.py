"""The datasets we prepare: where each lives on the Hub and how its columns map to our rows.

Hub ids, configs, splits and column names were checked against the dataset cards; the
evaluation sets are the ones the paper reports (AIME 2024 30, AIME 2025 30, AMC 83,
MATH-500 500, Minerva 272, OlympiadBench 675, GSM8K 1319). Each source also lists the column
names that common local copies use, so that a downloaded file works without options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from drpo_openrlhf.data.convert import (
    Converter,
    answer_alternatives,
    answer_list_text,
    answer_text,
    gsm8k_final_answer,
    math_converter,
)
from drpo_openrlhf.data.kk import kk_converter
from drpo_openrlhf.data.readers import HubRef

PROBLEM_KEYS = ("problem", "question", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer")


@dataclass(frozen=True)
class Source:
    """One output file: its Hub location, converter and whether labels are math answers."""

    name: str
    description: str
    hub: HubRef
    convert: Converter
    math: bool = True


def _math(
    name: str,
    description: str,
    hub: HubRef,
    answer_keys: tuple[str, ...] = ANSWER_KEYS,
    answer: Callable[[object, str], str] = answer_text,
) -> Source:
    converter = math_converter(name, PROBLEM_KEYS, answer_keys, answer)
    return Source(name, description, hub, converter)


def _people_splits(people: range) -> tuple[str, ...]:
    return tuple(f"{n}ppl" for n in people)


def build_sources(kk_train_people: range, kk_test_people: range) -> dict[str, Source]:
    """All sources by name; the K&K ones depend on the chosen puzzle sizes."""
    sources = [
        _math(
            "deepscaler",
            "DeepScaleR-Preview training set (~40.3k problems)",
            HubRef("agentica-org/DeepScaleR-Preview-Dataset", None, ("train",)),
        ),
        _math(
            "gsm8k",
            "GSM8K test (1319); label = text after '####'",
            HubRef("openai/gsm8k", "main", ("test",)),
            answer=gsm8k_final_answer,
        ),
        _math("math500", "MATH-500 (500)", HubRef("HuggingFaceH4/MATH-500", None, ("test",))),
        _math(
            "olympiadbench",
            "OlympiadBench text-only English math, open-ended (675)",
            HubRef("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", ("train",)),
            answer_keys=("final_answer", *ANSWER_KEYS),
            answer=answer_list_text,
        ),
        _math("aime2024", "AIME 2024 (30)", HubRef("HuggingFaceH4/aime_2024", None, ("train",))),
        _math("aime2025", "AIME 2025 (30)", HubRef("MathArena/aime_2025", None, ("train",))),
        _math(
            "amc",
            "AMC 12 2022-2023 with integer answers (83)",
            HubRef("AI-MO/aimo-validation-amc", None, ("train",)),
        ),
        _math(
            "minerva",
            "Minerva math (272); a list answer holds acceptable alternatives",
            HubRef("math-ai/minervamath", None, ("test",)),
            answer=answer_alternatives,
        ),
        Source(
            "kk-train",
            f"K&K logic puzzles, train, {kk_train_people[0]}-{kk_train_people[-1]} people",
            HubRef("K-and-K/knights-and-knaves", "train", _people_splits(kk_train_people)),
            kk_converter(kk_train_people),
            math=False,
        ),
        Source(
            "kk-test",
            f"K&K logic puzzles, test, {kk_test_people[0]}-{kk_test_people[-1]} people",
            HubRef("K-and-K/knights-and-knaves", "test", _people_splits(kk_test_people)),
            kk_converter(kk_test_people),
            math=False,
        ),
    ]
    return {source.name: source for source in sources}


GROUPS: dict[str, tuple[str, ...]] = {
    "math-eval": ("gsm8k", "math500", "olympiadbench", "aime2024", "aime2025", "amc", "minerva"),
    "kk": ("kk-train", "kk-test"),
}
