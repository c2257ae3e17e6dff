"""``make demo``'s own parts: the training commands it submits, how it follows and reports
them, and its tables. The runs themselves are the real pipeline, tested end to end in
``test_e2e_pipeline.py`` (the demo's command line is the same entry point)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from drpo_openrlhf import train
from drpo_openrlhf.demo.config import DemoConfig
from drpo_openrlhf.demo.results import MAIN_COLUMNS, format_table, misled_share, summary_rows
from drpo_openrlhf.demo.training import demo_runs, run_logged, train_command


def test_each_run_is_a_valid_drpo_openrlhf_train_command(tmp_path: Path) -> None:
    config = DemoConfig()
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "t.jsonl").write_text('{"prompt": "Compute 1+2.", "label": "3"}\n')
    runs = demo_runs(config)
    assert [r.name for r in runs] == ["DisCO", "DRPO-0.1", "RLOO-LP-0.2"]
    parsed = {}
    for run in runs:
        command = train_command(config.rl, run, tmp_path / "base", tmp_path / "t.jsonl", tmp_path)
        assert command[:3] == [sys.executable, "-m", "drpo_openrlhf.train"]
        options, argv = train.parse(command[3:])
        parsed[run.name] = (options.drpo, options, argv)
        flags = dict(zip(argv[::2], argv[1::2], strict=False))
        assert flags["--ckpt.output_dir"] == str(tmp_path / "models" / run.name)
        assert options.max_steps == config.rl.rollout_steps
    assert math.isinf(parsed["DisCO"][0].lam) and parsed["DisCO"][1].method is None
    assert parsed["DRPO-0.1"][0].lam == 0.1
    assert parsed["RLOO-LP-0.2"][1].method == "rloo_lp"
    assert parsed["RLOO-LP-0.2"][1].params == {"alpha": 0.2}
    assert "--algo.kl.init_coef" in parsed["RLOO-LP-0.2"][2]  # no reference model either


def test_run_logged_prints_steps_and_reports_failures(tmp_path: Path, capsys) -> None:
    lines = "; ".join(
        f"print(\"Global step {s}: {{'rollout/reward_mean': 0.{s}, "
        f"'rollout/response_length_mean': 1{s}.0}}\")"
        for s in (1, 2)
    )
    run_logged([sys.executable, "-c", lines], tmp_path / "ok.log", "X", 2, progress=True)
    assert capsys.readouterr().out.splitlines() == [
        "  X: step 1/2  reward 0.100  length 11.0",
        "  X: step 2/2  reward 0.200  length 12.0",
    ]
    assert "Global step 2" in (tmp_path / "ok.log").read_text()
    failing = [sys.executable, "-c", "print('the cause'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)Y failed \(exit 3\).*the cause"):
        run_logged(failing, tmp_path / "bad.log", "Y", 2, progress=False)


def test_misled_share_reads_either_method_s_tag(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    for name, tag, values in [
        ("drpo", "train/drpo/frac_correct_negative_signal", [0.0, 0.0]),
        ("rloo", "train/rollout/frac_correct_negative_signal", [0.1, 0.3]),
    ]:
        with SummaryWriter(tmp_path / name / "run") as writer:
            for step, value in enumerate(values, start=1):
                writer.add_scalar(tag, value, step)
                writer.add_scalar("train/other", 5.0, step)
    assert misled_share(tmp_path / "drpo") == 0.0
    assert misled_share(tmp_path / "rloo") == pytest.approx(0.2)
    assert misled_share(tmp_path / "empty") is None


def _doc(name: str, role: str, acc: float, length: float) -> dict:
    datasets = {"add2": {"pass@1": acc, "mean_length": length}}
    return {"name": name, "role": role, "average": datasets["add2"], "datasets": datasets}


def test_summary_rows_compare_with_reference_and_base() -> None:
    docs = [
        _doc("base", "base", 0.5, 40.0),
        _doc("DisCO", "reference", 0.6, 30.0),
        _doc("DRPO-0.1", "run", 0.6, 15.0),
    ]
    shapes = {d["name"]: {"add2": {"skipped": 0.1, "rechecks": 1.0}} for d in docs}
    rows = {r["name"]: r for r in summary_rows(docs, shapes)}
    drpo = rows["DRPO-0.1"]
    assert drpo["length_vs_reference"] == pytest.approx(-0.5)
    assert drpo["length_vs_base"] == pytest.approx(-0.625)
    assert drpo["pass@1_vs_base"] == pytest.approx(0.1)
    assert drpo["aes_vs_reference"] > rows["DisCO"]["aes_vs_reference"] == 0
    for row in rows.values():
        row["correct_pushed_down"] = None if row["name"] == "base" else 0.0
    table = format_table(list(rows.values()), list(MAIN_COLUMNS)).splitlines()
    assert table[0].split() == list(MAIN_COLUMNS)
    assert table[3].split()[:3] == ["DRPO-0.1", "60.0", "15.0"]
    assert table[1].split()[-1] == "-" and table[3].split()[-1] == "0.0"
