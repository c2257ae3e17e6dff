"""The suite's time scale (``tests/time_bounds.py``): measured cheaply, never below 1, set by
``DRPO_TEST_TIME_SCALE``; a bound that fails names itself, the scale and what it measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import time_bounds
from time_bounds import ENV_VAR, MAX_SCALE, Calibration

TESTS = Path(__file__).parent


@pytest.fixture
def scale_of(monkeypatch: pytest.MonkeyPatch):
    """Fixes this process's time scale for one test: ``scale_of(2.0)``."""

    def fix(scale: float) -> None:
        monkeypatch.setattr(time_bounds, "calibration", lambda: Calibration(scale, ENV_VAR))

    return fix


def test_the_measured_scale_is_at_least_1_at_most_the_cap_and_cheap():
    measured = time_bounds.measure()
    assert 1.0 <= measured.scale <= MAX_SCALE and measured.source == "measured"
    assert measured.python_ratio > 0 and measured.matmul_ratio > 0
    assert measured.cost_s < 1.0, measured.describe()
    assert "Python" in measured.describe() and "fp32 matmul" in measured.describe()
    assert time_bounds.calibration() is time_bounds.calibration()  # once per process


@pytest.mark.parametrize(
    ("reference_s", "scale"), [(1e3, 1.0), (1e-9, MAX_SCALE)], ids=["fast", "slow"]
)
def test_a_faster_machine_keeps_the_bound_and_a_slower_one_stops_at_the_cap(
    monkeypatch, reference_s, scale
):
    monkeypatch.setattr(time_bounds, "REFERENCE_PYTHON_S", reference_s)
    monkeypatch.setattr(time_bounds, "REFERENCE_MATMUL_S", reference_s)
    assert time_bounds.measure(repeats=1).scale == scale


def test_the_environment_sets_the_scale():
    assert time_bounds.from_environment({}) is None
    assert time_bounds.from_environment({ENV_VAR: " "}) is None
    set_by = time_bounds.from_environment({ENV_VAR: "2.5"})
    assert set_by == Calibration(2.5, ENV_VAR)
    assert set_by.describe() == f"time scale 2.50 (set by {ENV_VAR})"
    assert time_bounds.from_environment({ENV_VAR: "10"}).scale == 10.0  # no cap


@pytest.mark.parametrize("value", ["0.5", "0", "-2", "fast", "nan", "inf"])
def test_a_scale_below_1_or_not_a_number_is_refused(value):
    with pytest.raises(ValueError, match=f"{ENV_VAR}='{value}': .* a number from 1 up"):
        time_bounds.from_environment({ENV_VAR: value})


def test_a_fresh_process_takes_the_environment_s_scale_without_measuring():
    script = (
        "import sys, time_bounds; "
        "print(time_bounds.scaled(10), time_bounds.calibration().source, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(TESTS), ENV_VAR: "2.5"},
        capture_output=True,
        text=True,
        timeout=time_bounds.scaled(60),  # a bare interpreter: 0.1 s
    )
    assert done.stdout.split() == ["25.0", ENV_VAR, "False"], done.stderr


def test_a_bound_s_slack_is_stretched_by_the_scale_and_its_fixed_part_is_not(scale_of):
    scale_of(2.0)
    assert time_bounds.scaled(3) == 6.0
    assert time_bounds.bound_s(1.5) == 3.0
    assert time_bounds.bound_s(1.5, fixed_s=1.0) == 4.0  # 1 + 1.5 x 2, not (1 + 1.5) x 2


def test_assert_within_passes_inside_the_bound_and_fails_past_it_saying_what(scale_of):
    scale_of(2.0)
    time_bounds.assert_within(4.99, 2.5, "last_boxed on unclosed boxes")
    with pytest.raises(AssertionError) as failed:
        time_bounds.assert_within(5.2, 2.5, "last_boxed on unclosed boxes")
    message = str(failed.value)
    assert message.startswith("last_boxed on unclosed boxes: 5.20 s, over its bound of 5.00 s")
    assert "(2.5 s x time scale 2.00;" in message and ENV_VAR in message


def test_a_failed_bound_with_a_fixed_part_names_both(scale_of):
    scale_of(2.0)
    time_bounds.assert_within(3.99, 1.5, "a hanging reward call", fixed_s=1.0)
    with pytest.raises(AssertionError) as failed:
        time_bounds.assert_within(4.5, 1.5, "a hanging reward call", fixed_s=1.0)
    assert str(failed.value).startswith(
        "a hanging reward call: 4.50 s, over its bound of 4.00 s (1 s fixed by the test"
        " + 1.5 s x time scale 2.00 of slack;"
    )


def test_within_times_a_block_and_a_slow_one_fails(scale_of):
    scale_of(1.0)
    with time_bounds.within(5.0, "a quick block"):
        pass
    slow = (
        r"^a slow block: \d+\.\d\d s \(wall; this process's CPU 0\.\d\d s\), "
        r"over its bound of 0\.05"
    )
    with pytest.raises(AssertionError, match=slow), time_bounds.within(0.05, "a slow block"):
        time.sleep(0.2)
    # the block's own failure, not the bound's
    with pytest.raises(KeyError), time_bounds.within(0.0, "a failing block"):
        raise KeyError("x")


def test_on_the_cpu_clock_waiting_is_not_counted_and_spinning_is(scale_of):
    scale_of(1.0)
    with time_bounds.within(0.1, "a starved block", cpu=True):
        time.sleep(0.2)  # as a test whose worker gets no CPU
    spinning = r"^a runaway loop: \d+\.\d\d s \(CPU; wall \d+\.\d\d s\), over its bound of 0\.05"
    runaway = time_bounds.within(0.05, "a runaway loop", cpu=True)
    with pytest.raises(AssertionError, match=spinning), runaway:
        started = time.process_time()
        while time.process_time() - started < 0.2:
            pass


def test_a_poll_deadline_fails_once_passed_with_the_detail(scale_of):
    scale_of(1.0)
    waiting = time_bounds.Deadline(60, "the nodes to become idle")
    assert not waiting.expired()
    waiting.check("log")
    passed = time_bounds.Deadline(0, "munged's socket")
    assert passed.expired()
    with pytest.raises(AssertionError, match=r"(?s)^munged's socket: 0\.00 s, over .*\nslurmd: x$"):
        passed.check("slurmd: x")


def test_each_test_s_pytest_timeout_is_stretched_by_the_scale(request):
    if request.config.getoption("timeout") is not None or os.environ.get("PYTEST_TIMEOUT"):
        pytest.skip("--timeout or PYTEST_TIMEOUT given: the user's limit is kept")
    (seconds,) = request.node.get_closest_marker("timeout").args
    assert seconds == time_bounds.scaled(float(request.config.getini("timeout")))
