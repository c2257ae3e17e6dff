"""``--drpo.positive_reward SPEC``: the reward that ranks a prompt's correct responses.

DRPO weights the correct responses of a prompt by ``softmax(r(o) / lambda)`` over those
responses alone; today's ``r`` is the length reward. SPEC names another ``r``:

- a built-in: ``length`` (``r_l`` with ``--drpo.length_reward``'s shape and C),
  ``fewer_reflections``, ``fewer_answers`` (``rewards/preference.py``);
- ``path/to/file.py[:function]``: a function of that file (default ``positive_reward``);
- a weighted sum of those: ``length+0.5*fewer_reflections``, ``2*my_reward.py:style``.

A function is called once per prompt group with its correct responses,
``f(texts, lengths, labels)`` (plus ``prompt=`` if it takes that keyword), and returns one
finite float per response, larger = more preferred. ``load`` builds the callable the vLLM
engines run; ``probe`` runs it once on hand-written responses, so that a broken plugin is
refused before anything launches. Every problem raises ``PositiveRewardError`` naming the
SPEC, the file and what is wrong.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from drpo_openrlhf.rewards.preference import fewer_answers, fewer_reflections

DEFAULT_FUNCTION = "positive_reward"
BUILTINS = ("length", "fewer_reflections", "fewer_answers")
_TERM = re.compile(r"^\s*(?:(?P<weight>[^*]+?)\s*\*\s*)?(?P<name>\S.*?)\s*$")

# The probe: one prompt's correct responses, as a reasoning model writes them.
PROBE_PROMPT = "Compute 2+2."
PROBE_TEXTS = (
    "<think>\n2+2=4\n</think>\n\\boxed{4}",
    "<think>\n2+2=4\nWait, let me check.\n2+2=4\n</think>\nThe answer is 4.\n\\boxed{4}",
    "<think>\nHmm, 2+2. Two and two make four.\n</think>\n\\boxed{4}",
)
PROBE_LENGTHS = (12, 31, 20)
PROBE_LABELS = ("4", "4", "4")


class PositiveRewardError(ValueError):
    """A positive reward that cannot be loaded, or failed or answered wrongly."""


@dataclass(frozen=True)
class Term:
    """One summand of a SPEC: ``weight * name``, ``name`` a built-in or a file."""

    weight: float
    name: str
    function: str | None = None  # for a file: the function's name

    @property
    def is_file(self) -> bool:
        return self.function is not None

    @property
    def label(self) -> str:
        return f"{self.name}:{self.function}" if self.is_file else self.name


def parse(spec: str) -> list[Term]:
    """The terms of ``spec``; raises ``PositiveRewardError`` on an unknown name or weight."""
    if not isinstance(spec, str) or not spec.strip():
        raise PositiveRewardError("--drpo.positive_reward: empty; use 'length' (the default)")
    terms = []
    for part in spec.split("+"):
        match = _TERM.match(part)
        if match is None:
            raise PositiveRewardError(f"--drpo.positive_reward {spec}: empty term in a sum")
        weight = 1.0
        if match["weight"] is not None:
            try:
                weight = float(match["weight"])
            except ValueError:
                weight = math.nan
            if not math.isfinite(weight):
                raise PositiveRewardError(
                    f"--drpo.positive_reward {spec}: weight {match['weight']!r} is not a number"
                )
        name = match["name"]
        path, sep, function = name.partition(".py:")
        if sep or name.endswith(".py"):
            path = path + ".py" if sep else name
            if sep and not function.isidentifier():
                raise PositiveRewardError(
                    f"--drpo.positive_reward {spec}: {function!r} is not a function name"
                )
            terms.append(Term(weight, path, function if sep else DEFAULT_FUNCTION))
        elif name in BUILTINS:
            terms.append(Term(weight, name))
        else:
            raise PositiveRewardError(
                f"--drpo.positive_reward {spec}: unknown positive reward {name!r}; built-ins: "
                f"{', '.join(BUILTINS)}, or path/to/file.py[:function]"
            )
    return terms


def is_default(spec: str) -> bool:
    """The length reward alone, computed in the actor from token counts (today's DRPO)."""
    from drpo_openrlhf.algo.config import is_length_positive_reward  # imports torch: late

    return is_length_positive_reward(spec)


def files(spec: str) -> list[str]:
    """The plugin files ``spec`` names."""
    return [t.name for t in parse(spec) if t.is_file]


def with_paths(spec: str, resolve: Callable[[str], str]) -> str:
    """``spec`` with each file path replaced by ``resolve(path)`` (e.g. made absolute)."""
    out = []
    for term in parse(spec):
        name = f"{resolve(term.name)}:{term.function}" if term.is_file else term.name
        out.append(name if term.weight == 1.0 else f"{term.weight!r}*{name}")
    return "+".join(out)


def _length_term(max_len: float, shape: str) -> Callable:
    import torch

    from drpo_openrlhf.algo.length_reward import length_reward

    def length(texts, lengths, labels):
        counts = torch.tensor([float(n) for n in lengths], dtype=torch.float64)
        return length_reward(counts, max_len, shape).tolist()

    return length


def _load_function(spec: str, term: Term) -> Callable:
    where = f"--drpo.positive_reward {spec}: {term.name}"
    file = Path(term.name)
    if not file.is_file():
        raise PositiveRewardError(f"{where}: no such file")
    module_name = f"drpo_positive_reward_{abs(hash(str(file.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, file)
    if loader is None or loader.loader is None:
        raise PositiveRewardError(f"{where}: cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as error:  # any import-time failure of user code
        raise PositiveRewardError(
            f"{where}: importing it raised {type(error).__name__}: {error}"
        ) from error
    func = getattr(module, term.function, None)
    if func is None:
        raise PositiveRewardError(f"{where}: defines no function {term.function!r}")
    if not callable(func):
        raise PositiveRewardError(f"{where}: {term.function!r} is not a function")
    return func


def _takes_prompt(func: Callable, spec: str, term: Term) -> bool:
    """Whether ``func`` takes ``prompt=``; raises if it cannot be called as ``func(texts,
    lengths, labels)`` (with ``prompt=`` when it names that parameter)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return False  # a builtin without a signature: called with three arguments
    params = signature.parameters
    takes = "prompt" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        signature.bind([], [], [], **({"prompt": ""} if takes else {}))
    except TypeError as error:
        raise PositiveRewardError(
            f"--drpo.positive_reward {spec}: {term.label}{signature} cannot be called as "
            f"{term.function or term.name}(texts, lengths, labels) ({error})"
        ) from None
    return takes


def check_values(values: object, expected: int, where: str) -> list[float]:
    """``values`` as ``expected`` finite floats; ``PositiveRewardError`` naming ``where``."""
    if hasattr(values, "tolist") and not isinstance(values, list | tuple):
        values = values.tolist()  # a tensor or an array
    if not isinstance(values, list | tuple):
        raise PositiveRewardError(
            f"{where} returned a {type(values).__name__}, not one number per response"
        )
    if len(values) != expected:
        raise PositiveRewardError(f"{where} returned {len(values)} values for {expected} responses")
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        kinds = sorted({type(v).__name__ for v in values})
        raise PositiveRewardError(f"{where} returned non-numbers ({', '.join(kinds)})") from None
    bad = [v for v in floats if not math.isfinite(v)]
    if bad:
        raise PositiveRewardError(f"{where} returned non-finite values: {bad[:4]}")
    return floats


@dataclass(frozen=True)
class PositiveReward:
    """A loaded SPEC: ``reward(texts, lengths, labels, prompt)`` -> one float per response,
    the weighted sum of its terms, every term's answer checked."""

    spec: str
    terms: tuple[tuple[float, str, Callable, bool], ...]  # weight, label, function, prompt?

    def __call__(
        self,
        texts: Sequence[str],
        lengths: Sequence[int],
        labels: Sequence[str],
        prompt: str | None = None,
    ) -> list[float]:
        n = len(texts)
        if not len(lengths) == len(labels) == n:
            raise ValueError("texts, lengths and labels must have one entry per response")
        total = [0.0] * n
        for weight, label, func, takes_prompt in self.terms:
            where = f"--drpo.positive_reward {self.spec}: {label}"
            kwargs = {"prompt": prompt} if takes_prompt else {}
            try:
                values = func(list(texts), [int(x) for x in lengths], list(labels), **kwargs)
            except Exception as error:  # the plugin's own failure, named and re-raised
                raise PositiveRewardError(
                    f"{where} raised {type(error).__name__}: {error}"
                ) from error
            values = check_values(values, n, where)
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
        return total


def load(spec: str, max_len: float, length_shape: str = "linear") -> PositiveReward:
    """The callable of ``spec``; ``max_len`` and ``length_shape`` define its ``length`` term
    (C and the shape of ``r_l``). Imports plugin files; raises ``PositiveRewardError``."""
    terms = []
    for term in parse(spec):
        if term.name == "length":
            func: Callable = _length_term(max_len, length_shape)
        elif term.name == "fewer_reflections":
            func = fewer_reflections
        elif term.name == "fewer_answers":
            func = fewer_answers
        else:
            func = _load_function(spec, term)
        terms.append((term.weight, term.label, func, _takes_prompt(func, spec, term)))
    return PositiveReward(spec, tuple(terms))


def probe(spec: str, max_len: float, length_shape: str = "linear") -> PositiveReward:
    """``load(spec)`` and one call on ``PROBE_TEXTS``: what the run would do with a prompt's
    correct responses, before the run starts."""
    reward = load(spec, max_len, length_shape)
    lengths = [min(n, int(max_len)) for n in PROBE_LENGTHS]
    try:
        reward(list(PROBE_TEXTS), lengths, list(PROBE_LABELS), PROBE_PROMPT)
    except PositiveRewardError as error:
        raise PositiveRewardError(
            f"{error} (on the probe: {len(PROBE_TEXTS)} hand-written correct responses, "
            "before the run)"
        ) from error
    return reward
