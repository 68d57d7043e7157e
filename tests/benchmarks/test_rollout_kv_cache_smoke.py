"""benchmarks/rollout/kv_cache.py on the CPU with a tiny shape: every row runs, the files are written, the 8-bit
caches hold fewer bytes, and the row plan puts the bf16 baseline and the 8-bit caches at its batch first."""

from __future__ import annotations

import json

import pytest
from loader import load_benchmark

pytestmark = pytest.mark.usefixtures("single_thread")


def test_tiny_cpu_run_writes_every_row(tmp_path):
    kv = load_benchmark("rollout/kv_cache.py", keep_on_path=True)
    argv = ["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--base-batch", "2", "--batches",
            "2,4", "--prompt-len", "8", "--new-tokens", "6", "--agree-rows", "2", "--agree-tokens", "6"]  # fmt: skip
    assert kv.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["complete"] is True
    rows = result["results"]
    assert [(r["cache"], r["batch"]) for r in rows] == [
        ("bf16", 2), ("fp8", 2), ("int8", 2), ("fp8", 4), ("int8", 4), ("bf16", 4)
    ]  # fmt: skip
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in rows), rows
    assert {r["decode_mode_ran"] for r in rows} == {"eager"}  # the CPU runs the eager step, and says so
    mib = {(r["cache"], r["batch"]): r["cache_mib"] for r in rows}
    # fp32 on the CPU: one byte plus a 4-byte scale per 32-wide head vector, against four bytes
    assert mib[("int8", 2)] == pytest.approx(mib[("bf16", 2)] * (1 + 4 / 32) / 4, rel=0.02)
    assert mib[("fp8", 4)] == pytest.approx(2 * mib[("fp8", 2)], rel=0.02)
    agree = result["greedy_agreement"]["by_cache"]
    assert set(agree) == {"fp8", "int8"} and all(
        0 <= a["greedy_token_match_rate"] <= 1 for a in agree.values()
    )
    assert len(result["summary"]) == len(rows)
    assert (tmp_path / "results.csv").read_text().count("\n") == 1 + len(rows)


def test_bad_arguments_exit_with_status_2(tmp_path):
    kv = load_benchmark("rollout/kv_cache.py", keep_on_path=True)
    assert kv.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--caches", "fp4"]) == 2


def test_bf16_rows_only_where_the_caches_name_it():
    plan = load_benchmark("rollout/kv_cache.py", keep_on_path=True).plan
    assert plan(["int8"], 128, [128, 256]) == [("int8", 128), ("int8", 256)]
    assert plan(["bf16", "int8"], 128, [256]) == [("bf16", 128), ("int8", 128), ("int8", 256), ("bf16", 256)]


@pytest.mark.parametrize(
    "args,said",
    [
        (["--caches", "int8,int8"], "names a cache twice"),
        (["--agree-rows", "-3"], "--agree-rows must be 0"),
        (["--caches", "int9"], "bad --caches ['int9']"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, capsys, args, said):
    kv = load_benchmark("rollout/kv_cache.py", keep_on_path=True)
    assert kv.main(["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1


def test_an_out_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path, capsys):
    kv = load_benchmark("rollout/kv_cache.py", keep_on_path=True)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert kv.main(["--out", str(blocker / "x"), "--shape", "tiny", "--device", "cpu"]) == 2
    assert "cannot create the folder" in capsys.readouterr().err
