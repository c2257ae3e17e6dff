"""Independent, loop-based restatements of the paper's formulas, used as test oracles."""

from __future__ import annotations

import math

import torch


def groups_of(group_ids: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def closed_form_g1(scores, correct, group_ids, length_rewards, lam, tau) -> list[float]:
    """``dLoss/ds_i`` from Algorithm 1's ``G1`` (loss = -objective), written out by hand."""
    grad = [0.0] * len(scores)
    groups = groups_of(list(group_ids))
    for members in groups.values():
        pos = [i for i in members if correct[i]]
        neg = [i for i in members if not correct[i]]
        if not pos or not neg:
            continue
        if math.isinf(lam):
            w = {i: 1.0 / len(pos) for i in pos}
        else:
            top = max(length_rewards[i] / lam for i in pos)
            e = {i: math.exp(length_rewards[i] / lam - top) for i in pos}
            z = sum(e.values())
            w = {i: e[i] / z for i in pos}
        top = max(scores[j] / tau for j in neg)
        e = {j: math.exp(scores[j] / tau - top) for j in neg}
        z = sum(e.values())
        for i in pos:
            grad[i] = -w[i] / len(groups)
        for j in neg:
            grad[j] = e[j] / z / len(groups)
    return grad


def disco_loss(scores, correct, group_ids, tau) -> torch.Tensor:
    """DisCO's objective (paper Eq. 3) with empirical means, negated and averaged over prompts."""
    groups = groups_of(group_ids.tolist())
    total = scores.new_zeros(())
    for members in groups.values():
        idx = torch.tensor(members)
        pos, neg = idx[correct[idx]], idx[~correct[idx]]
        if len(pos) and len(neg):
            lme = torch.logsumexp(scores[neg] / tau, 0) - math.log(len(neg))
            total = total + scores[pos].mean() - tau * lme
    return -total / len(groups)
