"""The segment reductions under the objective (``algo/groups.py``), against plain per-group
torch on each group alone: values, empty groups and their gradients."""

import pytest
import torch

from drpo_openrlhf.algo.groups import dense_group_index, segment_logsumexp

pytestmark = pytest.mark.usefixtures("float64_default")


def per_group_logsumexp(values, group_ids, mask):
    """Each group's ``logsumexp`` over its masked entries, one group at a time."""
    out = []
    for g in torch.unique(group_ids, sorted=True):
        chosen = values[(group_ids == g) & mask]
        out.append(torch.logsumexp(chosen, 0) if chosen.numel() else values.new_tensor(-torch.inf))
    return torch.stack(out)


@pytest.mark.parametrize("scale", [1.0, 1e4])  # 1e4: exp overflows without the max shift
def test_segment_logsumexp_matches_each_group_alone(scale):
    gen = torch.Generator().manual_seed(0)
    group_ids = torch.tensor([5, 2, 5, 9, 2, 9, 7, 5, 7])
    mask = torch.tensor([True, False, True, False, False, False, True, False, False])
    values = torch.randn(group_ids.numel(), generator=gen) * scale
    index, num_groups = dense_group_index(group_ids)
    got = segment_logsumexp(values, index, num_groups, mask)
    expected = per_group_logsumexp(values, group_ids, mask)
    assert torch.isinf(expected).tolist() == [True, False, False, True]  # groups 2, 9: empty...
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)  # ...and -inf here too


def test_empty_groups_give_no_nan_gradient():
    """An empty group's ``-inf`` is masked out downstream (as the objective's groups without
    an incorrect response are): no NaN may reach any entry's gradient, and the gradient of a
    non-empty group is its softmax over the masked entries."""
    group_ids = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.tensor([True, True, False, False, True])
    values = torch.tensor([0.3, -1.2, 0.7, 2.0, -0.4], requires_grad=True)
    index, num_groups = dense_group_index(group_ids)
    out = segment_logsumexp(values, index, num_groups, mask)
    used = torch.where(torch.isfinite(out), out, 0.0).sum()
    (grad,) = torch.autograd.grad(used, values)
    assert torch.isfinite(grad).all(), grad
    expected = torch.cat([torch.softmax(values[:2], 0), torch.zeros(2), torch.ones(1)])
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-12, atol=0)


def test_an_unmasked_entry_far_above_its_group_leaves_no_nan():
    """exp of an unmasked entry 1000 above its group's masked maximum overflows; it must not
    enter the computation at all, or its zero gradient becomes NaN."""
    group_ids = torch.tensor([0, 0, 0])
    mask = torch.tensor([True, True, False])
    values = torch.tensor([0.5, -0.5, 1000.0], requires_grad=True)
    index, num_groups = dense_group_index(group_ids)
    out = segment_logsumexp(values, index, num_groups, mask)
    (grad,) = torch.autograd.grad(out.sum(), values)
    torch.testing.assert_close(out, torch.logsumexp(values[:2], 0).reshape(1).detach())
    expected = torch.cat([torch.softmax(values[:2], 0), torch.zeros(1)]).detach()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
