import pytest
import torch

from drpo_openrlhf.algo.advantages import group_advantages
from drpo_openrlhf.algo.baseline_rewards import shape_rewards
from drpo_openrlhf.algo.learning_signal import signal_diagnostics

LENGTHS = [1500, 1200, 1900, 2200, 2800, 2000, 3600, 6400, 1300, 1200]
CORRECT = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]


def test_by_hand():
    d = signal_diagnostics([0.5, -0.2, 0.1, -1.0], [1, 1, 0, 0])
    assert d == pytest.approx(
        {
            "frac_correct_negative": 0.5,
            "mean_signal_correct": 0.15,
            "mean_signal_incorrect": -0.45,
            "n_correct": 2.0,
            "n_incorrect": 2.0,
        }
    )


def test_zero_signal_is_not_negative():
    assert signal_diagnostics([0.0, 0.0], [1, 0])["frac_correct_negative"] == 0.0


def test_empty_sets_are_defined_and_nan_free():
    no_correct = signal_diagnostics([-1.0, -2.0], [0, 0])
    assert no_correct["frac_correct_negative"] == 0.0
    assert no_correct["mean_signal_correct"] == 0.0
    assert (no_correct["n_correct"], no_correct["mean_signal_incorrect"]) == (0.0, -1.5)
    no_incorrect = signal_diagnostics(torch.tensor([-1.0, 3.0]), torch.tensor([True, True]))
    assert no_incorrect["mean_signal_incorrect"] == 0.0 and no_incorrect["n_incorrect"] == 0.0
    assert no_incorrect["frac_correct_negative"] == 0.5
    assert signal_diagnostics([], [])["frac_correct_negative"] == 0.0


# Appendix table tab:advan: red entries (correct responses with a negative advantage).
@pytest.mark.parametrize(
    ("method", "hparams", "estimator", "misled"),
    [
        ("rloo_lp", {"alpha": 0.4}, "rloo", 1),
        ("alp", {"beta": 0.0001}, "grpo", 1),
        ("hapo", {"w": 1.0, "c": -0.7, "h": 1200}, "grpo", 6),  # "6 out of 10 cases"
        ("l1_max", {"alpha": 0.0003, "target_length": 4000, "delta": 0.5}, "grpo", 2),
        ("shorter_better", {"alpha": 2.0, "beta": 0.001}, "grpo", 2),
        ("laser_d", {"alpha": 0.5, "target_length": 4000}, "grpo", 1),
    ],
)
def test_paper_table_misleading_signals(method, hparams, estimator, misled):
    adv = group_advantages(shape_rewards(method, LENGTHS, CORRECT, **hparams), estimator)
    d = signal_diagnostics(adv, CORRECT)
    assert d["frac_correct_negative"] == misled / 8
    assert d["mean_signal_correct"] > 0 > d["mean_signal_incorrect"]


def test_drpo_signal_never_pushes_a_correct_response_down():
    # DRPO's per-group objective (paper): sum_pos w_hat s - tau logsumexp(s_neg / tau), with
    # w_hat = softmax(r_l / lambda) over the positives; the signal is -dloss/ds = dJ/ds.
    lam, tau = 0.1, 10.0
    s = torch.linspace(-1.0, -0.2, len(LENGTHS), dtype=torch.float64, requires_grad=True)
    pos = torch.tensor(CORRECT, dtype=torch.bool)
    r_l = 1 - torch.tensor(LENGTHS, dtype=torch.float64) / 8192
    w_hat = torch.softmax(r_l[pos] / lam, 0)
    objective = (w_hat * s[pos]).sum() - tau * torch.logsumexp(s[~pos] / tau, 0)
    (signal,) = torch.autograd.grad(objective, s)
    d = signal_diagnostics(signal, CORRECT)
    assert d["frac_correct_negative"] == 0.0
    assert d["mean_signal_correct"] == pytest.approx(1 / 8)  # weights sum to 1
    assert d["mean_signal_incorrect"] == pytest.approx(-1 / 2)  # softmax sums to 1
    # the same length reward folded into GRPO misleads the longest correct response
    grpo = group_advantages(
        [r if ok else 0.0 for r, ok in zip(r_l.tolist(), CORRECT, strict=True)], "grpo"
    )
    assert signal_diagnostics(grpo, CORRECT)["frac_correct_negative"] > 0


@pytest.mark.parametrize(
    ("signal", "correct", "match"),
    [
        ([1.0], [1, 0], "1 signals but 2 correctness"),
        ([float("nan"), 1.0], [1, 0], "finite"),
        ([1.0, 1.0], [1, -1], "0/1"),
    ],
)
def test_invalid_inputs(signal, correct, match):
    with pytest.raises(ValueError, match=match):
        signal_diagnostics(signal, correct)
