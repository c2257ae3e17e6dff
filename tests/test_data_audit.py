"""``drpo-data audit``: every label graded against itself, rewrites and wrong answers."""

from __future__ import annotations

import json

from drpo_openrlhf.data.audit import probes
from drpo_openrlhf.data.cli import main


def write(path, labels):
    rows = [{"prompt": f"p{i}", "label": lab, "datasource": "x"} for i, lab in enumerate(labels)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_clean_labels_pass(tmp_path, capsys):
    path = write(tmp_path / "a.jsonl", ["\\frac{1}{2}", "2.88e-19", '["0.01", "0.02"]', "x=5"])
    assert main(["audit", str(path)]) == 0
    assert f"{path}: 4 labels, 0 with findings" in capsys.readouterr().out


def test_labels_the_grader_cannot_handle_are_listed(tmp_path, capsys):
    path = write(tmp_path / "a.jsonl", ["7", "\\frac{", "E_{1},E_{2}"])
    assert main(["audit", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path} line 2: label '\\\\frac{{' rejects '\\\\frac{{' (" in out
    assert f"{path} line 1:" not in out
    assert f"{path}: 3 labels, " in out


def test_unreadable_file_exits_2(tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    path.write_text("not json\n")
    assert main(["audit", str(path)]) == 2
    assert "cannot audit" in capsys.readouterr().err


def test_probes_cover_rewrites_and_wrong_numbers():
    accept, reject = probes("0.00000288")
    assert "0.00000288." in accept and "2.88e-6" in accept and "2.88 \\times 10^{-6}" in accept
    assert [float(r) for r in reject] == [0.00000288 * 1.5 + 1]
    accept, reject = probes("y = 2x")
    assert "2x" in accept and reject == ["0", "2"]
    # MATH-500's thousands commas keep their form; list commas get the other spacing
    assert not any(", \\!" in a for a in probes("11,\\! 111,\\! 100")[0])
    assert "1,000" in probes("1,000")[0] and "1, 000" not in probes("1,000")[0]
    assert "(2, 3), 4" in probes("(2,3),4")[0]
