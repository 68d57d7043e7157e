"""benchmarks/common: environment capture, timing summaries, result files and charts."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import (  # noqa: E402
    bar_chart,
    environment,
    summarize,
    timed,
    tokens_per_update,
    write_csv,
    write_json,
)


def test_code_digest_changes_with_a_file_and_only_then(tmp_path):
    from benchmarks.common.env import code_digest

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "run.sh").write_text("echo hi\n")
    first = code_digest([tmp_path / "pkg"])
    (tmp_path / "pkg" / "notes.txt").write_text("not code")  # other files do not count
    assert code_digest([tmp_path / "pkg"]) == first
    (tmp_path / "pkg" / "sub" / "run.sh").write_text("echo ho\n")
    assert code_digest([tmp_path / "pkg"]) != first
    (tmp_path / "pkg" / "sub" / "run.sh").write_text("echo hi\n")
    assert code_digest([tmp_path / "pkg"]) == first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")  # same bytes, other file
    assert code_digest([tmp_path / "pkg"]) != first


def test_environment_names_versions_date_and_command(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = environment(smoke=True)
    assert {"gpu", "torch", "transformers", "python", "date", "command"} <= set(env)
    assert len(env["code_sha256"]) == 64
    assert env["omp_num_threads"] == "1" and env["smoke"] is True
    assert env["gpu"] is None or isinstance(env["gpu"], str)


def test_summarize_drops_the_warmup_and_reports_median_min_max():
    assert summarize([9.0, 3.0, 1.0, 2.0], warmup=1) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
        "warmup": [9.0],
    }
    assert summarize([4.0, 2.0])["median"] == 3.0
    with pytest.raises(ValueError, match="nothing left"):
        summarize([1.0], warmup=1)
    calls = []
    out = timed(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and out["n"] == 3 and len(out["samples"]) == 3 and out["min"] <= out["median"]


def test_write_json_reads_back_unchanged_one_record_per_line(tmp_path):
    data = {
        "environment": {"gpu": None, "torch": "2.x"},
        "rows": [{"name": "a", "x": 1.5, "curve": [1, 2, 3]}, {"name": "b", "x": math.inf}],
        "empty": [],
        "summary": "text",
    }
    path = write_json(tmp_path / "r" / "results.json", data)
    text = path.read_text()
    assert json.loads(text) == data
    lines = text.splitlines()
    assert any(line.strip().startswith('{"name": "a"') for line in lines)  # a row is one line
    assert len(lines) == 9
    assert json.loads(write_json(tmp_path / "l.json", [1, {"a": 2}]).read_text()) == [1, {"a": 2}]


def test_write_json_replaces_the_file_whole(tmp_path, monkeypatch):
    """A write cut short (here: the rename never happens) leaves the previous results intact."""
    path = write_json(tmp_path / "results.json", {"rows": [1, 2]})
    import benchmarks.common.results as results

    def killed(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(results.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"rows": [1, 2, 3]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    monkeypatch.undo()
    write_json(path, {"rows": [1, 2, 3]})
    assert json.loads(path.read_text()) == {"rows": [1, 2, 3]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # the next write took the leftover


def test_write_csv_and_bar_chart(tmp_path):
    rows = [{"system": "stock", "tokens_per_s": 1.0}, {"system": "ours", "tokens_per_s": 3.0, "extra": 1}]
    with write_csv(tmp_path / "r.csv", rows).open() as f:
        read = list(csv.DictReader(f))
    assert [r["system"] for r in read] == ["stock", "ours"] and read[0]["extra"] == ""
    png = bar_chart(tmp_path / "c.png", ["stock", "ours"], [1.0, 3.0], "t", "tokens / s", reference=1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tokens_per_update(8, 128, 384) == 4096
