"""Padding and micro-steps of OpenRLHF's shuffled micro-batches vs DRPO's grouped ones.

A rollout of ``prompts x n`` responses with long-tailed lengths (lognormal, clipped to the
generation budget) is laid out per data-parallel rank as

- *OpenRLHF*: each rank's contiguous share of the rollout, shuffled (``ActorPPOTrainer``'s
  ``DataLoader(shuffle=True, drop_last=True)``) into micro-batches of ``--micro-batch``;
- *DRPO*: ``plan_optimizer_steps`` without lengths (whole prompt groups per step, cut in
  group order), plus the no-grad scores pass DRPO runs on every step but a rollout's first;
- *DRPO sorted*: the same steps, each cut into micro-batches longest response first (what
  the DRPO actor does: it passes the lengths to ``plan_optimizer_steps``);
- *DRPO one-pass* (only when ``--micro-batch`` is a multiple of ``n``): micro-batches of whole
  groups, longest group first, and no scores pass (the actor's update for
  ``--drpo.kl_estimate microstep``);

each padded (a micro-batch is as wide as its longest row) or packed (no padding; a micro-batch
costs its token count); and, packed, under dynamic batching (``--train.dynamic_batch_enable``:
responses dealt to ranks by length, micro-batches under a token budget):

- *OpenRLHF dynamic*: its replay buffer's steps of ``train_batch / world`` consecutive
  responses per rank;
- *DRPO dynamic*: ``DRPOActorTrainer._plan_dynamic``'s steps of whole groups in id order,
  mirrored here with the same ``assign_group_steps`` and OpenRLHF balancing functions;
- *DRPO dyn. one-pass*: the same steps with ``--drpo.kl_estimate microstep``: groups packed
  into global micro-steps by ``pack_group_microsteps`` and no scores pass (a step that
  cannot be packed falls back to *DRPO dynamic*'s micro-batches and scores pass).
 A response's log-length is ``mu + sigma (sqrt(rho) z_prompt +
sqrt(1 - rho) z_response)``: ``rho`` is how alike the lengths of one prompt's responses are
(hard prompts give long answers), and is what grouping turns into less padding.

    python scripts/bench_data_layout.py                # 128 prompts x 8, 8 ranks, seconds
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

import torch
from openrlhf.utils.seqlen_balancing import (
    get_minimum_num_micro_batch_size,
    get_seqlen_balanced_partitions,
)

from drpo_openrlhf.update.layout import (
    Layout,
    assign_group_steps,
    pack_group_microsteps,
    plan_optimizer_steps,
)


@dataclass(frozen=True)
class Rollout:
    """Token counts (prompt + response) of each response, in generation order."""

    lengths: list[int]
    response_lengths: list[int]
    n: int


def sample_rollout(args: argparse.Namespace, rho: float, gen: torch.Generator) -> Rollout:
    prompts, n = args.prompts, args.n
    z_prompt = torch.randn(prompts, generator=gen).repeat_interleave(n)
    z_response = torch.randn(prompts * n, generator=gen)
    log_len = math.log(args.median) + args.sigma * (
        math.sqrt(rho) * z_prompt + math.sqrt(1 - rho) * z_response
    )
    response = log_len.exp().round().clamp(args.min_len, args.max_len).long()
    prompt_log = math.log(args.prompt_median) + 0.5 * torch.randn(prompts, generator=gen)
    prompt = prompt_log.exp().round().clamp(16, 1024).long().repeat_interleave(n)
    return Rollout((prompt + response).tolist(), response.tolist(), n)


def openrlhf_micro_steps(items: list[int], micro: int, gen: torch.Generator) -> list[list[int]]:
    """One rank's micro-batches in ``ActorPPOTrainer.ppo_train``: shuffled, last partial one
    dropped (never happens with a valid layout)."""
    order = [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]
    return [order[i : i + micro] for i in range(0, len(order) - micro + 1, micro)]


def drpo_micro_steps(
    items: list[int],
    rollout: Rollout,
    layout: Layout,
    by_length: bool = False,
    one_pass: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """One rank's gradient-pass micro-batches and its scores-pass (no-grad) micro-batches.

    ``by_length`` passes the lengths to ``plan_optimizer_steps``, which then cuts each
    optimizer step longest first (what the DRPO actor does): still whole groups per step.
    ``one_pass``: micro-batches of whole groups (sorted by length) and no scores pass."""
    groups = [i // rollout.n for i in items]
    lengths = [rollout.lengths[i] for i in items] if by_length or one_pass else None
    plan = plan_optimizer_steps(
        groups, rollout.n, layout, lengths=lengths, whole_groups_per_micro_batch=one_pass
    )
    steps = [[[items[i] for i in mb] for mb in step] for step in plan]
    scores_pass = [] if one_pass else [mb for step in steps[1:] for mb in step]
    return [mb for step in steps for mb in step], scores_pass


@dataclass
class Cost:
    micro_steps: int = 0  # forward+backward micro-batches per rank
    forward_only: int = 0  # DRPO's no-grad scores-pass micro-batches per rank
    real: int = 0  # tokens of the rollout (all ranks)
    processed: int = 0  # tokens a forward+backward pass computes on, padding included
    forward_processed: int = 0  # tokens the scores pass computes on
    largest: int = 0  # the widest micro-batch, in tokens: what sets activation memory
    slowest: int = 0  # sum over micro-steps of the slowest rank's tokens

    @property
    def padding(self) -> float:
        return 1 - self.real / self.processed


def micro_batch_tokens(mb: list[int], lengths: list[int], packed: bool) -> int:
    rows = [lengths[i] for i in mb]
    return sum(rows) if packed else len(rows) * max(rows)


def cost(
    per_rank: list[tuple[list[list[int]], list[list[int]]]], rollout: Rollout, packed: bool
) -> Cost:
    """Costs of a layout, given each rank's (gradient-pass, scores-pass) micro-batches.

    ``slowest`` assumes ranks synchronise every micro-step, as ZeRO-2/3 do (gradient
    reduce-scatter, parameter all-gather)."""
    tokens = [
        (
            [micro_batch_tokens(mb, rollout.lengths, packed) for mb in grad],
            [micro_batch_tokens(mb, rollout.lengths, packed) for mb in fwd],
        )
        for grad, fwd in per_rank
    ]
    grad, fwd = zip(*tokens, strict=True)
    return Cost(
        micro_steps=len(grad[0]),
        forward_only=len(fwd[0]),
        real=sum(rollout.lengths),
        processed=sum(map(sum, grad)),
        forward_processed=sum(map(sum, fwd)),
        largest=max(map(max, grad)),
        slowest=sum(map(max, zip(*grad, strict=True))),
    )


def dealt_by_length(lengths: list[int], world: int) -> list[list[int]]:
    """Each rank's responses, in order, under dynamic batching. OpenRLHF's
    ``balance_experiences`` sorts the rollout longest first, cuts it into runs of ``world``,
    alternates the longest runs with the shortest ones (reversed), and deals every run out one
    response per rank."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    runs = [order[i : i + world] for i in range(0, len(order), world)]
    half = len(runs) // 2
    long_runs, short_runs = runs[:half], [run[::-1] for run in runs[half:]]
    paired = [run for i in range(half) for run in (long_runs[i], short_runs[-(i + 1)])]
    paired += short_runs[:1] if len(short_runs) > half else []
    return [[run[r] for run in paired if r < len(run)] for r in range(world)]


def token_balanced(step: list[list[int]], lengths: list[int], budget: int) -> list[list[list[int]]]:
    """One optimizer step's micro-batches per rank under dynamic batching: the same number on
    every rank (the most any rank needs by first fit under the budget), balanced by tokens."""
    count = max(
        get_minimum_num_micro_batch_size([lengths[i] for i in s], budget, 1, 1) for s in step
    )
    return [
        [
            [items[j] for j in part]
            for part in get_seqlen_balanced_partitions([lengths[i] for i in items], count, False)
        ]
        for items in step
    ]


def one_pass_dynamic(
    steps: list[list[list[int]]], n: int, lengths: list[int], budget: int
) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Each rank's (gradient-pass, scores-pass) micro-batches when every step's groups are
    packed into global micro-steps (``steps[k][r]``: rank ``r``'s responses of step ``k``)."""
    per_rank: list[tuple[list[list[int]], list[list[int]]]] = [([], []) for _ in steps[0]]
    for k, step in enumerate(steps):
        shares: dict[int, list[int]] = {}
        for rank, items in enumerate(step):
            for i in items:
                shares.setdefault(i // n, [0] * len(step))[rank] += lengths[i]
        groups = pack_group_microsteps(shares, budget)
        if groups is None:
            micro, scores = token_balanced(step, lengths, budget), k > 0
        else:
            where = {g: j for j, gs in enumerate(groups) for g in gs}
            micro = [
                [[i for i in items if where[i // n] == j] for j in range(len(groups))]
                for items in step
            ]
            scores = False
        for (grad, fwd), mbs in zip(per_rank, micro, strict=True):
            grad.extend(mbs)
            fwd.extend(mbs if scores else [])
    return per_rank


def rank_lists(steps: list[list[list[list[int]]]], world: int, scores_pass: bool) -> list:
    """``steps[k][r]`` (micro-batches) as each rank's (gradient-pass, scores-pass) lists."""
    return [
        (
            [mb for step in steps for mb in step[r]],
            [mb for step in steps[1:] for mb in step[r]] if scores_pass else [],
        )
        for r in range(world)
    ]


def layouts(args: argparse.Namespace, rollout: Rollout, gen: torch.Generator) -> dict:
    """Each layout's per-rank (gradient-pass, scores-pass) micro-batches for one rollout, and
    whether it is also costed padded."""
    world, n, lengths = args.world, args.n, rollout.lengths
    size = args.prompts * n // world
    shares = [list(range(r * size, (r + 1) * size)) for r in range(world)]
    layout = Layout(world, n, args.prompts, args.train_batch, args.micro_batch)
    layout.check()
    dealt = dealt_by_length(lengths, world)
    local = args.train_batch // world
    step_of = assign_group_steps([i // n for i in range(len(lengths))], n, args.train_batch // n)
    steps = range(len(lengths) // args.train_batch)
    openrlhf_dynamic = [
        token_balanced([s[k * local : (k + 1) * local] for s in dealt], lengths, args.max_tokens)
        for k in steps
    ]
    drpo_steps = [[[i for i in s if step_of[i // n] == k] for s in dealt] for k in steps]
    drpo_dynamic = [token_balanced(step, lengths, args.max_tokens) for step in drpo_steps]
    one_pass = (
        {
            "DRPO one-pass": (
                [drpo_micro_steps(s, rollout, layout, one_pass=True) for s in shares],
                True,
            )
        }
        if layout.groups_fit_micro_batches
        else {}
    )
    return {
        "OpenRLHF": ([(openrlhf_micro_steps(s, args.micro_batch, gen), []) for s in shares], True),
        "DRPO": ([drpo_micro_steps(s, rollout, layout) for s in shares], True),
        "DRPO sorted": (
            [drpo_micro_steps(s, rollout, layout, by_length=True) for s in shares],
            True,
        ),
        **one_pass,
        "OpenRLHF dynamic": (rank_lists(openrlhf_dynamic, world, scores_pass=False), False),
        "DRPO dynamic": (rank_lists(drpo_dynamic, world, scores_pass=True), False),
        "DRPO dyn. one-pass": (
            one_pass_dynamic(drpo_steps, n, lengths, args.max_tokens),
            False,
        ),
    }


def run(args: argparse.Namespace, rho: float) -> dict[tuple[str, bool], list[Cost]]:
    gen = torch.Generator().manual_seed(args.seed)
    results: dict[tuple[str, bool], list[Cost]] = {}
    for _ in range(args.rollouts):
        rollout = sample_rollout(args, rho, gen)
        for name, (ranks, padded_too) in layouts(args, rollout, gen).items():
            for packed in (False, True) if padded_too else (True,):
                results.setdefault((name, packed), []).append(cost(ranks, rollout, packed))
    return dict(sorted(results.items(), key=lambda item: item[0][1]))  # padded rows first


def table(results: dict[tuple[str, bool], list[Cost]], args: argparse.Namespace) -> list[str]:
    mean = lambda costs, f: statistics.fmean(f(c) for c in costs)  # noqa: E731
    lines = [
        f"  {'layout':24}{'micro-steps':>12}{'+no-grad':>9}{'padding':>9}{'grad':>7}"
        f"{'scores':>8}{'total':>7}{'largest':>9}{'slowest':>9}",
        f"  {'':24}{'per rank':>12}{'(DRPO)':>9}{'':>9}{'pass':>7}{'pass':>8}{'':>7}"
        f"{'micro':>9}{'rank':>9}",
    ]
    base = {packed: mean(results["OpenRLHF", packed], lambda c: c.processed) for packed in (0, 1)}
    for (name, packed), costs in results.items():
        grad = mean(costs, lambda c: c.processed) / base[packed]
        scores = mean(costs, lambda c: c.forward_processed) / base[packed]
        lines.append(
            f"  {name + (' packed' if packed else ' padded'):24}"
            f"{mean(costs, lambda c: c.micro_steps):12.0f}"
            f"{mean(costs, lambda c: c.forward_only):9.0f}"
            f"{mean(costs, lambda c: c.padding):9.1%}"
            f"{grad:7.3f}{scores:8.3f}{grad + args.forward_cost * scores:7.3f}"
            f"{mean(costs, lambda c: c.largest):9.0f}"
            f"{mean(costs, lambda c: c.slowest) * args.world / base[packed]:9.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=128, help="prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--world", type=int, default=8, help="data-parallel actor ranks")
    p.add_argument("--train-batch", type=int, default=256, help="responses per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="responses per micro-batch")
    p.add_argument("--median", type=float, default=3000, help="median response length")
    p.add_argument("--sigma", type=float, default=0.9, help="std of log response length")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=8192, help="generation budget (clip)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16192,
        help="dynamic batching's --train.max_tokens_per_gpu",
    )
    p.add_argument("--prompt-median", type=float, default=150, help="median prompt length")
    p.add_argument(
        "--forward-cost",
        type=float,
        default=1 / 3,
        help="no-grad forward / forward+backward per token (1/4 with gradient checkpointing)",
    )
    p.add_argument("--rho", type=float, nargs="+", default=[0.0, 0.5, 0.8])
    p.add_argument("--rollouts", type=int, default=20, help="rollouts averaged over")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    print(
        f"{args.prompts} prompts x {args.n} responses, {args.world} ranks, optimizer steps of "
        f"{args.train_batch}, micro-batch {args.micro_batch}; response length lognormal "
        f"(median {args.median:g}, sigma {args.sigma:g}) clipped to {args.min_len}.."
        f"{args.max_len}; means over {args.rollouts} rollouts"
    )
    print(
        "token columns are relative to OpenRLHF's forward+backward tokens with the same padding:"
        "\n  grad pass = tokens computed by forward+backward, padding included; scores pass = "
        "DRPO's no-grad forwards;\n  total = grad + scores x forward cost "
        f"({args.forward_cost:.3g}); slowest rank = sum over micro-steps of the slowest rank's "
        "tokens x ranks\n  (ranks wait for each other every micro-step under ZeRO-2/3); "
        "largest micro = tokens of the widest micro-batch (activation memory)"
    )
    for rho in args.rho:
        gen = torch.Generator().manual_seed(args.seed)
        sample = sample_rollout(args, rho, gen).response_lengths
        truncated = sum(x >= args.max_len for x in sample) / len(sample)
        print(
            f"\nrho {rho:g}: mean response {statistics.fmean(sample):.0f} tokens, "
            f"{truncated:.0%} at the budget"
        )
        print("\n".join(table(run(args, rho), args)))


if __name__ == "__main__":
    main()
