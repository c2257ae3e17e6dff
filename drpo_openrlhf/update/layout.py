"""Which responses go into which optimizer step and micro-batch, so that groups stay whole.

DRPO's objective couples the responses of a prompt, so every optimizer step must see whole
prompt groups. OpenRLHF hands each data-parallel rank a contiguous slice of the rollout, in
which a prompt's responses are contiguous; the plan below keeps every group inside one
optimizer step and splits each step into the micro-batches DeepSpeed accumulates over.
Groups may still be cut across micro-batches: the exact split of the gradient
(``drpo_openrlhf.algo.minibatch``) makes that harmless. Nothing here imports OpenRLHF.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from drpo_openrlhf.flags import flag


class LayoutError(ValueError):
    """A batch layout under which DRPO's gradient could not be computed exactly."""


def data_parallel_size(
    actor_gpus: int, ring_attn_size: int = 1, tensor_parallel_size: int = 1
) -> int:
    """Actor ranks that hold different responses: OpenRLHF hands each group of
    ``ring_attn_size x tensor_parallel_size`` consecutive ranks (which split every packed
    sequence, or every layer, between them) the same share of the rollout, so the layout
    counts groups, not ranks."""
    shared = ring_attn_size * tensor_parallel_size
    if ring_attn_size < 1 or tensor_parallel_size < 1 or actor_gpus % shared:
        raise LayoutError(
            f"--ds.ring_attn_size x --ds.tensor_parallel_size ({ring_attn_size} x "
            f"{tensor_parallel_size}) must divide the {actor_gpus} actor GPUs "
            "(--actor.num_nodes x --actor.num_gpus_per_node)"
        )
    return actor_gpus // shared


@dataclass(frozen=True)
class Layout:
    """The batch arithmetic of one run, per data-parallel rank (``world_size``: their number,
    ``data_parallel_size``)."""

    world_size: int
    n_samples_per_prompt: int
    rollout_batch_size: int  # prompts per rollout step
    train_batch_size: int  # responses per optimizer step, all ranks together
    micro_batch_size: int  # responses per micro-batch on one rank
    dynamic_batching: bool = False  # micro-batches by token budget; groups may span ranks

    @property
    def samples_per_step(self) -> int:
        """Responses one rank trains on per optimizer step."""
        return self.train_batch_size // self.world_size

    @property
    def micro_steps(self) -> int:
        """Micro-batches (gradient-accumulation steps) per optimizer step on one rank."""
        return self.samples_per_step // self.micro_batch_size

    @property
    def groups_fit_micro_steps(self) -> bool:
        """Whether a global micro-step (micro-batch ``j`` of every rank, ``micro_batch_size x
        world_size`` responses) can hold whole prompt groups under ``deal_rollout``; not under
        dynamic batching."""
        m, world, n = self.micro_batch_size, self.world_size, self.n_samples_per_prompt
        return not self.dynamic_batching and (m * world) % n == 0

    @property
    def groups_fit_micro_batches(self) -> bool:
        """Whether micro-batches can hold whole prompt groups (each rank holds whole groups
        and the micro-batch size is a multiple of ``n``); not under dynamic batching."""
        return not self.dynamic_batching and self.micro_batch_size % self.n_samples_per_prompt == 0

    def check(self) -> None:
        """Raise ``LayoutError`` naming the first flag combination that breaks groups."""
        n, world = self.n_samples_per_prompt, self.world_size
        rollout = self.rollout_batch_size * n
        if n < 2:
            raise LayoutError(
                "DRPO compares the responses of a prompt: set --rollout.n_samples_per_prompt >= 2"
            )
        if self.train_batch_size % n:
            raise LayoutError(
                f"--train.batch_size ({self.train_batch_size} responses) must be a multiple of "
                f"n_samples_per_prompt ({n}), so that each optimizer step holds whole prompt groups"
            )
        if rollout % self.train_batch_size:
            raise LayoutError(
                f"--train.batch_size ({self.train_batch_size}) must divide the rollout's "
                f"{rollout} responses (--rollout.batch_size x n_samples_per_prompt); otherwise "
                "the last prompts of each rollout would be dropped"
            )
        if self.dynamic_batching:  # the ranks' shares and micro-batches are planned per step
            return
        if self.train_batch_size % world:
            raise LayoutError(
                f"--train.batch_size ({self.train_batch_size} responses) must be a multiple of "
                f"the {world} actor ranks, so that every rank trains on as many per step"
            )
        if self.samples_per_step % self.micro_batch_size:
            raise LayoutError(
                f"--train.micro_batch_size ({self.micro_batch_size}) must divide the "
                f"{self.samples_per_step} responses each rank trains on per optimizer step "
                "(--train.batch_size / actor ranks)"
            )


def layout_from_args(args: object, world_size: int | None = None) -> Layout:
    """The layout of OpenRLHF's flags ``args``, flat as the entry point parses them or nested
    as its actors hold them (``flags.flag``), on ``world_size`` data-parallel ranks; by
    default as many as the flags make (``data_parallel_size``). The one place a ``Layout`` is
    built from flags: the entry point's check, the driver's deal and the actor's plan agree."""
    if world_size is None:
        gpus = flag(args, "actor.num_nodes") * flag(args, "actor.num_gpus_per_node")
        ring, tp = flag(args, "ds.ring_attn_size"), flag(args, "ds.tensor_parallel_size")
        world_size = data_parallel_size(gpus, ring, tp)
    return Layout(
        world_size=world_size,
        n_samples_per_prompt=flag(args, "rollout.n_samples_per_prompt"),
        rollout_batch_size=flag(args, "rollout.batch_size"),
        train_batch_size=flag(args, "train.batch_size"),
        micro_batch_size=flag(args, "train.micro_batch_size"),
        dynamic_batching=flag(args, "train.dynamic_batch_enable"),
    )


def _whole_groups(
    group_ids: Sequence[int], n_samples_per_prompt: int, where: str, allow_partial: bool
) -> list[int]:
    """Ids of the groups with all ``n`` responses, in id order.

    An incomplete group is an error, unless ``allow_partial`` (the short last rollout of an
    episode, whose chunking OpenRLHF does not align to groups): then it is left out."""
    counts = Counter(group_ids)
    broken = {g: c for g, c in counts.items() if c != n_samples_per_prompt}
    if broken and not allow_partial:
        g, c = next(iter(broken.items()))
        raise LayoutError(
            f"prompt group {g} has {c} responses {where} instead of "
            f"n_samples_per_prompt={n_samples_per_prompt}: groups were split or filtered"
        )
    return sorted(g for g in counts if g not in broken)


def _check_fill(kept: int, per_step: int, where: str, allow_partial: bool) -> None:
    if kept % per_step and not allow_partial:
        raise LayoutError(
            f"{kept} responses {where} do not fill whole optimizer steps of {per_step}"
        )


def assign_group_steps(
    group_ids: Sequence[int],
    n_samples_per_prompt: int,
    groups_per_step: int,
    *,
    allow_partial: bool = False,
) -> dict[int, int]:
    """Optimizer step of every prompt group of a rollout (all ranks' ids): groups in id
    order, ``groups_per_step`` at a time. Used with dynamic batching, where OpenRLHF spreads a
    group's responses over ranks; only their scalars need to meet, so that is harmless.
    With ``allow_partial``, incomplete groups and the groups beyond the last whole step are
    left out of the mapping (their responses are not trained on)."""
    groups = _whole_groups(group_ids, n_samples_per_prompt, "in the rollout", allow_partial)
    n = n_samples_per_prompt
    _check_fill(len(groups) * n, groups_per_step * n, "in the rollout", allow_partial)
    usable = len(groups) - len(groups) % groups_per_step
    return {g: k // groups_per_step for k, g in enumerate(groups[:usable])}


def plan_optimizer_steps(
    group_ids: Sequence[int],
    n_samples_per_prompt: int,
    layout: Layout,
    *,
    lengths: Sequence[int] | None = None,
    allow_partial: bool = False,
    whole_groups_per_micro_batch: bool = False,
) -> list[list[list[int]]]:
    """Plan one rank's replay buffer: ``steps[k][j]`` lists the items of micro-batch ``j`` of
    optimizer step ``k``.

    Items are ordered by prompt group (stable), so each step holds whole groups. Within a step,
    given ``lengths`` (tokens per item), items are sorted longest first before being cut into
    micro-batches, so that each micro-batch pads to similar lengths (the objective does not
    depend on the cut). With ``whole_groups_per_micro_batch`` (needs
    ``layout.groups_fit_micro_batches``) whole groups are sorted instead, by their longest
    item, so that every micro-batch holds whole groups. Raises ``LayoutError`` if a group is
    incomplete on this rank or the items do not fill a whole number of steps: both would
    silently change the objective. With ``allow_partial`` such items are left out of the plan
    instead (the caller reports them).
    """
    if whole_groups_per_micro_batch and not layout.groups_fit_micro_batches:
        raise LayoutError(
            f"micro-batches of {layout.micro_batch_size} responses cannot hold whole groups of "
            f"{n_samples_per_prompt}"
        )
    keep = set(_whole_groups(group_ids, n_samples_per_prompt, "on this rank", allow_partial))
    order = sorted(
        (i for i in range(len(group_ids)) if group_ids[i] in keep),
        key=lambda i: (group_ids[i], i),
    )
    per_step = layout.samples_per_step
    _check_fill(len(order), per_step, "on this rank", allow_partial)
    micro = layout.micro_batch_size
    plan = []
    for s in range(0, len(order) - per_step + 1, per_step):
        step = order[s : s + per_step]
        if lengths is not None and whole_groups_per_micro_batch:
            longest: dict[int, int] = {}
            for i in step:
                longest[group_ids[i]] = max(longest.get(group_ids[i], 0), lengths[i])
            step = sorted(step, key=lambda i: (-longest[group_ids[i]], group_ids[i], i))
        elif lengths is not None:
            step = sorted(step, key=lambda i: -lengths[i])
        plan.append([step[m : m + micro] for m in range(0, per_step, micro)])
    return plan


def pack_group_microsteps(
    shares: Mapping[int, Sequence[int]], max_tokens: int
) -> list[list[int]] | None:
    """Global micro-steps of whole groups for the one-pass update under dynamic batching.

    ``shares[g][r]`` is the number of tokens group ``g`` (of one optimizer step) has on rank
    ``r``; groups are packed first-fit, largest per-rank share first, so that every rank's
    share of a micro-step stays within ``max_tokens``. Returns the groups of each micro-step,
    or ``None`` when the one-pass layout is impossible: a group over the budget on some
    rank, or a rank without any response in some micro-step (every rank must run the same
    number of forwards for ZeRO's collectives, and an empty micro-batch cannot run).
    """
    steps: list[list[int]] = []
    loads: list[list[int]] = []
    for g in sorted(shares, key=lambda g: (-max(shares[g]), g)):
        share = shares[g]
        if max(share) > max_tokens:
            return None
        for groups, load in zip(steps, loads, strict=True):
            if all(used + t <= max_tokens for used, t in zip(load, share, strict=True)):
                groups.append(g)
                load[:] = [used + t for used, t in zip(load, share, strict=True)]
                break
        else:
            steps.append([g])
            loads.append(list(share))
    if any(used == 0 for load in loads for used in load):
        return None
    return steps


def plan_dynamic_steps(
    everyone: Sequence[Sequence[tuple[int, int]]],
    rank: int,
    layout: Layout,
    *,
    max_tokens: int,
    pack_microsteps: bool,
    allow_partial: bool,
    micro_batches_needed: Callable[[list[int], int], int],
    balanced_parts: Callable[[list[int], int], list[list[int]]],
) -> tuple[list[list[list[int]]], list[str]]:
    """One rank's plan under dynamic batching, from every rank's ``(group id, tokens)`` per
    response (``everyone[r]``, in rank ``r``'s order): ``steps[k][j]`` lists this rank's items
    of micro-batch ``j`` of optimizer step ``k``, and each step's mode.

    Steps hold whole groups over all ranks (``assign_group_steps``) and every rank the same
    number of micro-batches (ZeRO's collectives need equal forward counts). With
    ``pack_microsteps`` (the per-micro-step KL) a step's groups are packed into global
    micro-steps under ``max_tokens`` (``pack_group_microsteps``: one pass) where they fit;
    otherwise each rank's share is cut into the micro-batch count the busiest rank needs
    (``micro_batches_needed``), balanced by tokens (``balanced_parts``, OpenRLHF's
    functions in production), and the step runs a scores pass. Every rank computes the
    same plan from the same ``everyone``, so a step no rank can run raises on all of them."""
    world = layout.world_size
    step_of = assign_group_steps(
        [g for pairs in everyone for g, _ in pairs],
        layout.n_samples_per_prompt,
        layout.train_batch_size // layout.n_samples_per_prompt,
        allow_partial=allow_partial,
    )
    shares = {g: [0] * world for g in step_of}  # tokens of each group on each rank
    for r, pairs in enumerate(everyone):
        for g, length in pairs:
            if g in shares:
                shares[g][r] += length
    group_ids = [g for g, _ in everyone[rank]]
    lengths = [length for _, length in everyone[rank]]
    plan, modes = [], []
    for k in range(len(set(step_of.values()))):
        members = [
            [i for i, (g, _) in enumerate(pairs) if step_of.get(g) == k] for pairs in everyone
        ]
        mine = members[rank]
        if pack_microsteps:
            microsteps = pack_group_microsteps(
                {g: shares[g] for g, step in step_of.items() if step == k}, max_tokens
            )
            if microsteps is not None:
                where = {g: j for j, groups in enumerate(microsteps) for g in groups}
                plan.append(
                    [[i for i in mine if where[group_ids[i]] == j] for j in range(len(microsteps))]
                )
                modes.append(ONE_PASS)
                continue
        count = max(
            micro_batches_needed([everyone[r][i][1] for i in members[r]], max_tokens)
            for r in range(world)
        )
        short = [r for r in range(world) if len(members[r]) < count]
        if short:
            raise LayoutError(
                f"optimizer step {k} gives rank(s) {short} fewer responses than the "
                f"{count} micro-batches the busiest rank needs: raise --train.max_tokens_per_gpu"
            )
        parts = balanced_parts([lengths[i] for i in mine], count)
        plan.append([[mine[j] for j in part] for part in parts])
        modes.append(SCORES_PASS)
    return plan, modes


UNTRAINED = -1  # slot of a response no optimizer step trains on (short last rollout)


def deal_rollout(
    group_ids: Sequence[int],
    layout: Layout,
    *,
    allow_partial: bool = False,
    lengths: Sequence[int] | None = None,
) -> list[list[tuple[int, int]]]:
    """The cross-rank layout: which rollout positions each rank receives, and in which slot.

    Groups go to optimizer steps in id order, ``train_batch_size / n`` at a time. A step's
    responses, group after group, are dealt round-robin: position ``p`` goes to rank
    ``p % world_size`` as its ``p // world_size``-th response of the step, and rank rows
    ``j*m .. j*m+m-1`` form its micro-batch ``j``. So global micro-step ``j`` (micro-batch
    ``j`` of every rank) is the step's positions ``j*m*W .. (j+1)*m*W - 1``: whole groups
    whenever ``n`` divides ``m*W`` (``Layout.groups_fit_micro_steps``). With ``W = n`` rank
    ``r`` holds response ``r`` of every prompt, as in the released code.

    Given ``lengths`` (tokens per response), each rank's responses of a step are cut into its
    micro-batches longest first instead, so that they pad little; global micro-steps then no
    longer hold whole groups, so only for an update that does not depend on the cut (the
    scores pass under the mini-batch KL).

    Returns, per rank, ``(position, slot)`` pairs in slot order; ``slot = k * micro_steps + j``
    for micro-batch ``j`` of step ``k``, or ``UNTRAINED`` for responses left out (incomplete
    groups or groups beyond the last whole step, only with ``allow_partial``), dealt
    round-robin after the rest. Raises ``LayoutError`` like ``assign_group_steps``.
    """
    n, world = layout.n_samples_per_prompt, layout.world_size
    groups_per_step = layout.train_batch_size // n
    step_of = assign_group_steps(group_ids, n, groups_per_step, allow_partial=allow_partial)
    members: dict[int, list[int]] = {g: [] for g in sorted(step_of)}
    for i, g in enumerate(group_ids):
        if g in members:
            members[g].append(i)
    groups = list(members)
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for k in range(len(groups) // groups_per_step):
        step = [
            i for g in groups[k * groups_per_step : (k + 1) * groups_per_step] for i in members[g]
        ]
        for r in range(world):
            mine = step[r::world]
            if lengths is not None:
                mine = sorted(mine, key=lambda i: -lengths[i])
            for q, i in enumerate(mine):
                ranks[r].append((i, k * layout.micro_steps + q // layout.micro_batch_size))
    rest = [i for i, g in enumerate(group_ids) if g not in step_of]
    for p, i in enumerate(rest):
        ranks[p % world].append((i, UNTRAINED))
    return ranks


def plan_from_slots(slots: Sequence[int], layout: Layout) -> list[list[list[int]]]:
    """One rank's plan from the slots ``deal_rollout`` gave its responses: ``steps[k][j]``
    lists the items of micro-batch ``j`` of optimizer step ``k``. Raises ``LayoutError``
    unless every slot of every step holds exactly ``micro_batch_size`` items."""
    per_slot = layout.micro_batch_size
    trained = [s for s in slots if s != UNTRAINED]
    num_slots = max(trained, default=-1) + 1
    counts = Counter(trained)
    if num_slots % layout.micro_steps or any(counts[s] != per_slot for s in range(num_slots)):
        raise LayoutError(
            f"this rank's responses do not fill micro-batches of {per_slot} in "
            f"{layout.micro_steps} micro-steps per optimizer step: the rollout was not dealt "
            f"for this layout (slot counts {dict(sorted(counts.items()))})"
        )
    where: dict[int, list[int]] = {s: [] for s in range(num_slots)}
    for i, s in enumerate(slots):
        if s != UNTRAINED:
            where[s].append(i)
    m = layout.micro_steps
    return [[where[k * m + j] for j in range(m)] for k in range(num_slots // m)]


# how the actor runs an optimizer step of fixed micro-batches (``actor_trainer``); the driver
# reads it too, to cut the micro-batches it deals
ONE_PASS, PENALTY_PASS, SCORES_PASS = "one_pass", "penalty_pass", "scores_pass"


def fixed_batch_mode(layout: Layout, kl_estimate: str) -> str:
    """How a step of fixed micro-batches runs: one pass, one pass plus a penalty pass when
    needed, or a scores pass first (global micro-steps cannot hold whole groups)."""
    if not layout.groups_fit_micro_steps:
        return SCORES_PASS
    return ONE_PASS if kl_estimate == "microstep" else PENALTY_PASS


def cut_longest_first(layout: Layout, kl_estimate: str) -> bool:
    """Whether the driver cuts each rank's share of a step into micro-batches longest first
    (``deal_rollout``'s ``lengths``): only where the update does not depend on the cut, the
    scores pass under the mini-batch KL."""
    return fixed_batch_mode(layout, kl_estimate) == SCORES_PASS and kl_estimate == "minibatch"
