"""The sweep file: what to train (methods x parameter grid x seeds), from which base, and how
to evaluate it, read into plain data. Every problem found is collected, not raised one by one,
so that one error message can list them all (``validate.py``)."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drpo_openrlhf.algo.baseline_rewards import METHODS as BASELINES

# Curve name in plots, and the parameter that traces it (paper, Figure 2)
DISPLAY = {
    "drpo": "DRPO",
    "disco": "DRPO",  # DisCO is DRPO at lambda = inf: the square on DRPO's curve
    "rloo_lp": "RLOO-LP",
    "alp": "ALP",
    "hapo": "HAPO",
    "l1_max": "L1-Max",
    "shorter_better": "ShorterBetter",
    "laser_d": "LASER-D",
}
METHOD_NAMES = ("drpo", "disco", *BASELINES)
SEED = "{seed}"

TOP_KEYS = {"name", "output_dir", "seeds", "train", "methods", "eval", "local", "slurm", "ray"}
SECTION_KEYS = {
    "train": {"base_model", "data", "flags"},
    "eval": {"data", "flags", "datasets"},
    "local": {"num_gpus"},
    "slurm": {"recipe", "throttle", "sbatch_args", "env"},
    "ray": {"address", "submit_args"},
}
METHOD_KEYS = {"method", "label", "grid", "params", "flags"}


class SweepError(ValueError):
    """Every problem of a sweep, one per line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s), nothing submitted:\n{listed}")


@dataclass(frozen=True)
class Run:
    """One training run (or, for role ``base``, the base model's evaluation only)."""

    name: str
    method: str  # one of METHOD_NAMES, or "base"
    params: tuple[tuple[str, float], ...]
    seed: int | None
    base_model: str
    train_data: str
    eval_data: tuple[str, ...]
    flags: tuple[str, ...]  # the method's own extra train flags
    # names a variant of a method (its own flags): its run names and its curve in the report
    label: str | None = None

    @property
    def role(self) -> str:
        """How drpo-eval labels it: DisCO is the AES reference, the base a grey line."""
        return {"base": "base", "disco": "reference"}.get(self.method, "run")

    @property
    def trains(self) -> bool:
        return self.method != "base"

    @property
    def display(self) -> str | None:
        return self.label or DISPLAY.get(self.method)

    @property
    def param_name(self) -> str | None:
        if self.method == "disco":
            return "lambda"
        return ",".join(k for k, _ in self.params) or None

    @property
    def param(self) -> str | None:
        if self.method == "disco":
            return "inf"
        return ",".join(format_value(v) for _, v in self.params) or None


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file; ``runs`` is the expanded grid, base evaluations first."""

    name: str
    source: Path
    output_dir: Path
    train_flags: tuple[str, ...]
    eval_flags: tuple[str, ...]
    eval_datasets: tuple[str, ...] | None
    runs: tuple[Run, ...]
    local: dict[str, Any] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    ray: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str) -> Run:
        for run in self.runs:
            if run.name == name:
                return run
        raise KeyError(f"sweep {self.name} has no run {name!r}")

    def run_dir(self, run: Run) -> Path:
        return self.output_dir / run.name


def format_value(value: float) -> str:
    """``0.1``, ``1e-08``, ``inf``, ``4000``: short and stable, for names and labels."""
    if math.isinf(value):
        return "inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text)


def run_name(method: str, params: tuple[tuple[str, float], ...], seed: int | None) -> str:
    """``drpo-lambda0.1-s0``, ``disco-s0``, ``hapo-w0.1-s2``, ``base`` (the output dir,
    Slurm's RUN_NAME and the result name)."""
    parts = [method, *(f"{k}{format_value(v)}" for k, v in params)]
    if seed is not None:
        parts.append(f"s{seed}")
    return _name_part("-".join(parts))


def read_file(path: Path) -> dict[str, Any]:
    """TOML (``.toml``) or JSON: the resolved copy a sweep keeps in its output dir."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    import tomllib

    return tomllib.loads(text)


def _strings(value: Any, where: str, problems: list[str]) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{where} must be a list of strings, got {value!r}")
        return ()
    return tuple(value)


def _number(value: Any) -> float | None:
    """A grid value: a number, or "inf" (DRPO's lambda for DisCO)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf"):
        return math.inf
    return None


def _combinations(entry: dict, where: str, problems: list[str]) -> list[dict[str, float]]:
    """The cartesian product of ``grid`` (name -> list of values), each merged with the
    fixed ``params``; one empty combination when neither is given."""
    grid, fixed = entry.get("grid", {}), entry.get("params", {})
    combos: list[dict[str, float]] = []
    if not isinstance(grid, dict) or not isinstance(fixed, dict):
        problems.append(f"{where}: grid and params must be tables (name = values)")
        return combos
    names, axes = [], []
    for name, values in grid.items():
        values = values if isinstance(values, list) else [values]
        numbers = [_number(v) for v in values]
        if not values or None in numbers:
            problems.append(
                f"{where}: grid.{name} must be a non-empty list of numbers, got {values!r}"
            )
            return combos
        names.append(name)
        axes.append(numbers)
    constants = {}
    for name, value in fixed.items():
        number = _number(value)
        if number is None:
            problems.append(f"{where}: params.{name} must be a number, got {value!r}")
            return combos
        constants[name] = number
    overlap = sorted(set(names) & set(constants))
    if overlap:
        problems.append(f"{where}: {overlap} are both in grid and params")
        return combos
    for values in itertools.product(*axes):
        combos.append({**dict(zip(names, values, strict=True)), **constants})
    return combos


def _method_problem(method: str, params: dict[str, float]) -> str | None:
    """Why ``method`` cannot run with ``params`` (the trainer's own checks), or None."""
    if method == "disco":
        return (
            f"disco takes no parameters (it is lambda = inf), got {sorted(params)}"
            if params
            else None
        )
    if method == "drpo":
        if set(params) != {"lambda"}:
            return f"drpo takes one parameter, lambda (grid.lambda), not {sorted(params)}"
        if not params["lambda"] > 0:
            return f"drpo: lambda must be > 0 or inf, got {format_value(params['lambda'])}"
        return None
    from drpo_openrlhf.algo.group_shaper import GroupRewardShaper

    try:  # what `--shaping.method M --shaping.params ...` is checked with
        GroupRewardShaper(method, 8, **params)
    except ValueError as error:
        return str(error)
    return None


def _expand(text: str, seed: int | None) -> str:
    return text.replace(SEED, str(seed)) if seed is not None else text


def seeded_flags(flags: tuple[str, ...], seed: int | None) -> tuple[str, ...]:
    """Train flags with ``{seed}`` replaced by the run's seed, e.g. a per-seed
    ``--eval.dataset`` for the in-training evaluations the cost report reads."""
    return tuple(_expand(flag, seed) for flag in flags)


def _label(value: Any, where: str, problems: list[str]) -> str | None:
    """A variant's name (e.g. ``drpo_pass_rate`` for DRPO with a lambda schedule): it
    replaces the method in run names, so it must differ from every method's."""
    if value is None:
        return None
    reserved = ("base", *METHOD_NAMES)
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9._]+", value):
        problems.append(f"{where}: label must be letters, digits, '.' or '_', got {value!r}")
    elif value in reserved:
        problems.append(f"{where}: label {value!r} is a method's name; pick another")
    else:
        return value
    return None


def _sections(data: dict[str, Any], problems: list[str]) -> dict[str, dict[str, Any]]:
    """The file's tables, each reduced to a dict, with every unknown key reported: a typo
    would otherwise be ignored silently."""
    for key in sorted(set(data) - TOP_KEYS):
        problems.append(f"unknown key {key!r} (known: {', '.join(sorted(TOP_KEYS))})")
    sections: dict[str, dict[str, Any]] = {}
    for section, keys in SECTION_KEYS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            problems.append(f"[{section}] must be a table")
            table = {}
        for key in sorted(set(table) - keys):
            problems.append(f"[{section}]: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        sections[section] = table
    return sections


def _sweep_name(data: dict[str, Any], problems: list[str]) -> str:
    """The sweep's name, or ``sweep`` when it is not one a directory can carry: it names the
    output dir."""
    name = data.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        problems.append(f"name must be letters, digits, '.', '_' or '-', got {name!r}")
        name = "sweep"
    return name


def _seeds(data: dict[str, Any], problems: list[str]) -> list[int]:
    """The seeds, each once; empty when they are not integers >= 0, so nothing expands."""
    seeds = data.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
    ):
        problems.append(f"seeds must be a non-empty list of integers >= 0, got {seeds!r}")
        seeds = []
    elif len(set(seeds)) != len(seeds):
        problems.append(f"seeds repeat: {seeds}")
        seeds = list(dict.fromkeys(seeds))
    return seeds


# one grid point of a [[methods]] entry: (method, params, flags, label)
_Variant = tuple[str, tuple[tuple[str, float], ...], tuple[str, ...], str | None]


def _method_variants(entry: Any, where: str, problems: list[str]) -> list[_Variant]:
    """One ``[[methods]]`` entry's valid grid points; a point that cannot run is reported and
    left out, so that the rest still expand."""
    if not isinstance(entry, dict):
        problems.append(f"{where} must be a table")
        return []
    for key in sorted(set(entry) - METHOD_KEYS):
        problems.append(f"{where}: unknown key {key!r} (known: {', '.join(sorted(METHOD_KEYS))})")
    method = entry.get("method")
    if method not in METHOD_NAMES:
        problems.append(f"{where}: unknown method {method!r} (known: {', '.join(METHOD_NAMES)})")
        return []
    where = f"{where} ({method})"
    flags = _strings(entry.get("flags", []), f"{where} flags", problems)
    label = _label(entry.get("label"), where, problems)
    variants: list[_Variant] = []
    for params in _combinations(entry, where, problems):
        if method == "drpo" and math.isinf(params.get("lambda", 0.0)):
            method_here, params = "disco", {}  # lambda = inf is DisCO
        else:
            method_here = method
        label_here = None if method_here == "disco" else label
        problem = _method_problem(method_here, params)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        variants.append((method_here, tuple(params.items()), flags, label_here))
    return variants


def _seeded_runs(
    method: str,
    params: tuple[tuple[str, float], ...],
    seeds: Sequence[int | None],
    inputs: tuple[str, str, tuple[str, ...]],
    flags: tuple[str, ...] = (),
    label: str | None = None,
) -> list[Run]:
    """One run per seed, with ``{seed}`` in the base model, train data and eval sets
    (``inputs``) filled in: per-seed inputs give each seed its own files."""
    base_model, train_data, eval_data = inputs
    return [
        Run(
            run_name(label or method, params, seed),
            method,
            params,
            seed,
            _expand(base_model, seed),
            _expand(train_data, seed),
            tuple(_expand(d, seed) for d in eval_data),
            flags,
            label,
        )
        for seed in seeds
    ]


def parse_sweep(data: dict[str, Any], source: Path, problems: list[str]) -> Sweep | None:
    """The sweep described by ``data`` (a parsed file), or None when it cannot even be
    expanded; each problem found is appended to ``problems``."""
    sections = _sections(data, problems)
    name = _sweep_name(data, problems)
    seeds = _seeds(data, problems)

    train, evaluation = sections["train"], sections["eval"]
    base_model, train_data = train.get("base_model"), train.get("data")
    for key, value in (("base_model", base_model), ("data", train_data)):
        if not isinstance(value, str) or not value:
            problems.append(f"[train] {key} is required (a path or Hugging Face id)")
    eval_data = _strings(evaluation.get("data", []), "[eval] data", problems)
    if not eval_data:
        problems.append("[eval] data: at least one JSONL evaluation set is required")
    datasets = evaluation.get("datasets")
    if datasets is not None:
        datasets = _strings(datasets, "[eval] datasets", problems)

    methods = data.get("methods")
    if not isinstance(methods, list) or not methods:
        problems.append("[[methods]]: at least one method is required")
        methods = []
    if not isinstance(base_model, str) or not isinstance(train_data, str) or not seeds:
        return None

    inputs = (base_model, train_data, eval_data)
    per_seed = any(SEED in text for text in (base_model, train_data, *eval_data))
    base_seeds: list[int | None] = list(seeds) if per_seed else [None]
    runs = _seeded_runs("base", (), base_seeds, inputs)
    for index, entry in enumerate(methods, 1):
        for method, params, flags, label in _method_variants(
            entry, f"[[methods]] #{index}", problems
        ):
            runs += _seeded_runs(method, params, seeds, inputs, flags, label)
    names = [r.name for r in runs]
    for duplicate in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"run {duplicate} appears {names.count(duplicate)} times in the grid")

    output_dir = data.get("output_dir", f"outputs/sweeps/{name}")
    return Sweep(
        name=name,
        source=source,
        output_dir=Path(output_dir).expanduser().resolve(),
        train_flags=_strings(train.get("flags", []), "[train] flags", problems),
        eval_flags=_strings(evaluation.get("flags", []), "[eval] flags", problems),
        eval_datasets=datasets,
        runs=tuple(runs),
        local=sections["local"],
        slurm=sections["slurm"],
        ray=sections["ray"],
    )
