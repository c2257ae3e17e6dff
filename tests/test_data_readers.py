"""Reading raw rows from local json/jsonl/parquet files and (faked or offline) Hub."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from time_bounds import within

from drpo_openrlhf.data.readers import HubRef, SourceError, read_hub, read_local

FIXTURES = Path(__file__).parent / "fixtures" / "data"


def test_jsonl_rows_carry_line_numbers():
    rows = list(read_local(FIXTURES / "gsm8k.jsonl"))
    assert [r.location for r in rows] == [f"{FIXTURES / 'gsm8k.jsonl'} line {i}" for i in (1, 2, 3)]
    assert all(isinstance(r.record, dict) and r.error is None for r in rows)
    assert rows[0].record["answer"].endswith("#### 26")


def test_jsonl_blank_lines_keep_numbering_and_bad_lines_become_error_rows():
    path = FIXTURES / "bad" / "math_rows.jsonl"
    rows = list(read_local(path))
    numbers = [int(r.location.rsplit(" ", 1)[1]) for r in rows]
    assert numbers == [*range(1, 13), 14]  # line 13 is blank
    bad = [r for r in rows if r.error is not None]
    assert [r.location for r in bad] == [f"{path} line 7"]
    assert bad[0].record is None and bad[0].error.startswith("invalid JSON")


def test_json_array_rows_are_numbered_from_one():
    rows = list(read_local(FIXTURES / "deepscaler.json"))
    assert [r.location.rsplit(" ", 2)[1:] for r in rows] == [["row", str(i)] for i in range(1, 5)]
    assert rows[2].record["answer"] == "\\frac{3}{4}"


def test_json_lines_content_under_a_json_name(tmp_path):
    path = tmp_path / "saved_by_to_json.json"
    path.write_text('{"problem": "a", "answer": 1}\n{"problem": "b", "answer": 2}\n')
    rows = list(read_local(path))
    assert [r.record["answer"] for r in rows] == [1, 2]
    assert rows[1].location == f"{path} line 2"


def test_invalid_json_array_is_a_source_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"problem": "a", "answer": 1},')
    with pytest.raises(SourceError, match=re.escape("broken.json: invalid JSON array")):
        list(read_local(path))


def test_parquet_rows_keep_column_types(tmp_path):
    records = [json.loads(line) for line in (FIXTURES / "amc.jsonl").read_text().splitlines()]
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("problem", pa.string()),
            ("answer", pa.float64()),
            ("url", pa.string()),
        ]
    )
    path = tmp_path / "amc.parquet"
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    rows = list(read_local(path))
    assert [r.record for r in rows] == records
    assert isinstance(rows[0].record["answer"], float)
    assert rows[2].location == f"{path} row 3"


def test_folder_reads_its_files_in_name_order():
    rows = list(read_local(FIXTURES / "kk" / "train"))
    files = [Path(r.location.rsplit(" line ", 1)[0]).name for r in rows]
    assert files == ["people2_num1.jsonl", "people3_num1.jsonl", "people4_num1.jsonl"]
    assert [len(r.record["names"]) for r in rows] == [2, 3, 4]


@pytest.mark.parametrize(
    ("name", "message"),
    [("missing.jsonl", "no such file or folder"), ("data.csv", "unsupported file type '.csv'")],
)
def test_unreadable_paths_are_source_errors(tmp_path, name, message):
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text("problem,answer\n")
    with pytest.raises(SourceError, match=re.escape(message)):
        list(read_local(path))


def test_empty_folder_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="folder holds no"):
        list(read_local(tmp_path))


def test_hub_rows_come_from_each_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return datasets.Dataset.from_list([{"problem": f"{split} p{i}"} for i in range(2)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = HubRef("org/puzzles", "train", ("3ppl", "4ppl"))
    rows = list(read_hub(hub, "kk-train"))
    assert calls == [("org/puzzles", "train", "3ppl"), ("org/puzzles", "train", "4ppl")]
    assert [r.record["problem"] for r in rows] == ["3ppl p0", "3ppl p1", "4ppl p0", "4ppl p1"]
    assert rows[3].location == "org/puzzles (train/4ppl) row 2"


def test_hub_failure_says_how_to_use_local_files(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(SourceError) as info:
        list(read_hub(HubRef("openai/gsm8k", "main", ("test",)), "gsm8k"))
    message = str(info.value)
    assert "cannot load gsm8k from the Hugging Face Hub: openai/gsm8k (main/test)" in message
    assert "ConnectionError: Couldn't reach" in message
    assert "--input gsm8k=PATH" in message


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="needs HF_HUB_OFFLINE=1")
def test_real_offline_hub_failure_is_fast_and_explained():
    # wall time, as a wait on the network is what it rules out: 0.001 s measured in the suite,
    # 1.1-1.9 s in a fresh process that imports datasets first (2 cores at load 6-7); 30 s
    # is 16x the latter
    failing = pytest.raises(SourceError, match="--input minerva=PATH")
    with within(30, "an offline Hub's failure"), failing:
        list(read_hub(HubRef("drpo-openrlhf-tests/no-such-dataset", None, ("test",)), "minerva"))
