"""The weight probe's text and its two comparisons: every vLLM engine against every other, and
each engine against the actor.

After each exact weight check (the digests) every engine and the actor score one fixed text
token by token. The digests prove the engines hold the actor's weights; the probe shows what
they compute with them (a rotary base, a compute dtype, a kernel the digests cannot see).

- Engines against engines: identical engines scoring the probe alone, in the same shape, give
  the same bits (measured on an H200 and on CPU), so any per-token difference above
  ``ENGINE_TOLERANCE`` means an engine computes something else. The engines outside the
  largest group of agreeing engines are named; without a largest group, all of them. Only
  engines of one kind (device model, vLLM and torch builds: the same kernels, on any node)
  are held to each other; a mixed job's kinds are each held to the actor.
- Engines against the actor: the honest gap depends on hardware, kernels and precision
  (CPU toys 0.0005-0.0025 nats per token, SmolLM2-135M in bf16 0.043-0.046; on an H200 the
  same text as one row of a batch of 8 moved by 0.016, bf16 against fp32 by 0.018), so each
  engine's limit comes from its own first checked probe of the run (``ACTOR_FACTOR`` times
  it, at least ``ACTOR_FLOOR``), and never above ``ACTOR_CAP``, which also bounds the first.

No OpenRLHF, vLLM or Ray import: the driver's trainer and the tests share it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from drpo_openrlhf.sync.logprob_gap import probe_gap

PROBE_TOKENS = 1024  # long enough for position faults (rotary base, scaling) to show
ENGINE_TOLERANCE = 1e-6  # nats: largest per-token difference between identical engines
ACTOR_FACTOR = 4.0  # an engine's limit against the actor: this many times its first gap...
ACTOR_FLOOR = 0.005  # ...at least this (nats per token), so an exact kernel match cannot stop
ACTOR_CAP = 0.1  # ...and at most this: 2x the largest honest gap measured (0.046)
GUARDS = ("all", "engines", "actor", "log")  # --drpo.weight_probe: which comparisons stop


class WeightProbeError(RuntimeError):
    """An engine scores the probe differently from the other engines or from the actor."""


def probe_text(sentences: int) -> str:
    """A fixed text in the shape of the rollouts (arithmetic, reasoning words, a boxed answer),
    generated from the sentence index alone, so it is the same on every machine."""
    words = ("Wait, let me check.", "So the total is correct.", "Hmm, first we add.", "")
    parts = []
    for i in range(sentences):
        a, b = (37 * i + 11) % 97, (53 * i + 29) % 89
        parts.append(
            f"Step {i}: {a} + {b} = {a + b}, and {a} * {b} = {a * b}. {words[i % len(words)]}"
        )
    return " ".join(parts) + " Therefore, the answer is \\boxed{42}."


def probe_token_ids(tokenizer: Callable[..., Mapping[str, list[int]]], count: int) -> list[int]:
    """The first ``count`` token ids of ``probe_text`` under ``tokenizer`` (no special tokens)."""
    sentences = max(1, count // 8)
    while True:
        ids = tokenizer(probe_text(sentences), add_special_tokens=False)["input_ids"]
        if len(ids) >= count:
            return ids[:count]
        sentences *= 2


def engine_disagreements(
    scores: list[list[float]],
    tolerance: float = ENGINE_TOLERANCE,
    kinds: list[str] | None = None,
) -> tuple[list[str], float]:
    """Engines that score the probe differently from the others of their kind:
    ``(problems, largest)``, one line per named engine and the largest per-token difference
    between two engines of a kind.

    ``kinds`` (one per engine; default: all one kind) says which engines run the same
    kernels: the same device model and vLLM/torch build, on any node (``engine_settings``).
    Only those are held to each other bit for bit; engines of other kinds (a mixed job that
    ``--drpo.allow_engine_difference device`` let start) are not compared with each other,
    each still against the actor. Within a kind engines agree when no token differs by more
    than ``tolerance``; they are grouped by agreement with the lowest-numbered engine of each
    group. The largest group is taken as the reference and the others named; when no group is
    larger than every other (two engines that disagree, or three that all do), every engine of
    the kind is named."""
    kinds = kinds or [""] * len(scores)
    problems: list[str] = []
    largest = 0.0
    for kind in dict.fromkeys(kinds):
        members = [i for i, k in enumerate(kinds) if k == kind]
        found, spread = _disagreements(scores, members, tolerance)
        problems += found
        largest = max(largest, spread)
    return problems, largest


def _disagreements(
    scores: list[list[float]], members: list[int], tolerance: float
) -> tuple[list[str], float]:
    """``engine_disagreements`` among the engines ``members`` (run numbers) of one kind."""

    def diff(i: int, j: int) -> float:
        return max(abs(x - y) for x, y in zip(scores[i], scores[j], strict=True))

    largest = max((diff(i, j) for i in members for j in members if j < i), default=0.0)
    groups: list[list[int]] = []
    for i in members:
        home = next((g for g in groups if diff(g[0], i) <= tolerance), None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    if len(groups) == 1:
        return [], largest
    sizes = sorted((len(g) for g in groups), reverse=True)
    reference = max(groups, key=len) if sizes[0] > sizes[1] else []
    problems: list[str] = []
    for group in groups:
        if group is reference:
            continue
        for i in group:
            others = reference or [j for j in members if j not in group]
            worst = max(others, key=lambda j: diff(i, j))
            against = f"engines {_listed(reference)}" if reference else "every other engine"
            problems.append(
                f"engine {i} scores the probe differently from {against}: up to "
                f"{diff(i, worst):.3g} nats per token (engine {worst})"
            )
    return problems, largest


def _listed(engines: list[int]) -> str:
    return ", ".join(str(i) for i in engines)


@dataclass
class ActorLimits:
    """Each engine's limit on its mean probe gap to the actor: ``ACTOR_FACTOR`` times the gap
    of its first probe in this run (always of exactly checked weights), at least
    ``ACTOR_FLOOR`` and at most ``ACTOR_CAP``; the first probe itself must stay under the cap."""

    baselines: dict[int, float] = field(default_factory=dict)

    def limit(self, engine: int) -> float:
        baseline = self.baselines.get(engine)
        if baseline is None:
            return ACTOR_CAP
        return min(max(ACTOR_FACTOR * baseline, ACTOR_FLOOR), ACTOR_CAP)

    def check(self, gaps: list[float]) -> tuple[list[str], list[str]]:
        """``(problems, notes)`` for the engines' mean gaps ``gaps`` to the actor; an engine's
        first gap becomes its baseline (a note says so) unless it is itself over the cap."""
        problems, notes = [], []
        for engine, gap in enumerate(gaps):
            limit = self.limit(engine)
            if gap > limit:
                first = engine not in self.baselines
                source = (
                    "the cap, first probe" if first else f"first gap {self.baselines[engine]:.3g}"
                )
                problems.append(
                    f"engine {engine} is {gap:.3g} nats per token from the actor "
                    f"(limit {limit:.3g}: {source})"
                )
            elif engine not in self.baselines:
                self.baselines[engine] = gap
                notes.append(
                    f"engine {engine}: honest probe gap {gap:.3g}, limit from now on "
                    f"{self.limit(engine):.3g} (max({ACTOR_FACTOR:g} x honest, {ACTOR_FLOOR:g}), "
                    f"at most {ACTOR_CAP:g})"
                )
        return problems, notes


@dataclass
class ProbeResult:
    """One probe's numbers and verdict, for the log, the metrics and the error."""

    gaps: list[tuple[float, float]]  # per engine: mean and max |engine - actor|
    engine_spread: float  # largest per-token difference between two engines
    problems: list[str]
    notes: list[str]

    def metrics(self) -> dict[str, float]:
        out = {"drpo/probe_logprob_gap": max(mean for mean, _ in self.gaps)}
        out |= {f"drpo/probe_logprob_gap/engine_{i}": m for i, (m, _) in enumerate(self.gaps)}
        if len(self.gaps) > 1:
            out["drpo/probe_engine_spread"] = self.engine_spread
        return out


def compare_probe(
    actor: list[float],
    engines: list[list[float]],
    limits: ActorLimits,
    guard: str = "all",
    kinds: list[str] | None = None,
) -> ProbeResult:
    """Both comparisons of one probe. ``guard`` (``GUARDS``) says which of them may stop the
    run; the other's findings are kept as notes, and an engine's baseline is set all the same.
    ``kinds``: which engines run the same kernels (``engine_disagreements``)."""
    if guard not in GUARDS:
        raise ValueError(f"weight probe guard {guard!r} is not one of {GUARDS}")
    gaps = [probe_gap(actor, scores) for scores in engines]
    between, spread = engine_disagreements(engines, kinds=kinds)
    against_actor, notes = limits.check([mean for mean, _ in gaps])
    problems: list[str] = []
    for kind, found in (("engines", between), ("actor", against_actor)):
        if guard in ("all", kind):
            problems += found
        else:
            notes += [f"{line} (not stopping: --drpo.weight_probe {guard})" for line in found]
    return ProbeResult(gaps, spread, problems, notes)
