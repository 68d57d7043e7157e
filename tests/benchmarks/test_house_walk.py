"""benchmarks/house/walk.py: the rules that count one update's walk through the package's files
(``every_call``, ``package``, ``folder``), checked on calls made here, without a trainer."""

from __future__ import annotations

import sys

import torch

from rapidfire_hf.precision.metrics import first_tensor
from tests.benchmarks.loader import load_benchmark

walk = load_benchmark("house/walk.py")


def _traced(fn, *args):
    w = walk.Walk()
    sys.setprofile(w.hook)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return w.calls


def test_a_call_from_outside_crosses_and_its_calls_in_the_same_file_do_not():
    t = torch.zeros(1)
    calls = _traced(first_tensor, ([None, {"a": t}],))  # recurses inside precision/metrics.py
    assert len(calls) > 3 and {(f, fn) for f, fn, _, _ in calls} == {("precision/metrics.py", "first_tensor")}
    assert [by for *_, by in calls] == [None] + ["precision/metrics.py"] * (len(calls) - 1)  # None: this test
    for rule in ("package", "folder"):
        assert [walk.RULES[rule](f, by) for f, _, _, by in calls] == [True] + [False] * (len(calls) - 1)
    assert all(walk.RULES["every_call"](f, by) for f, _, _, by in calls)


def test_the_rules_tell_packages_and_folders_apart():
    package, folder = walk.RULES["package"], walk.RULES["folder"]
    assert (
        package("ppo/core.py", "ppo/scoring.py") is False and folder("ppo/core.py", "ppo/scoring.py") is False
    )
    assert package("ppo/core.py", "ppo/recipe/trainer.py") is False  # one package, the ppo part
    assert folder("ppo/core.py", "ppo/recipe/trainer.py") is True  # two folders: recipe and components
    assert (
        package("optim/pipeline.py", "ppo/stepper.py") is True and folder("optim/pipeline.py", None) is True
    )


def test_folders_tell_the_recipe_from_the_components():
    assert walk.folder("ppo/recipe/trainer.py") == "ppo/recipe"
    assert walk.folder("ppo/core.py") == "ppo"
    assert walk.folder("__init__.py") == ""
    assert walk.folder(None) is None
    assert walk.package("ppo/recipe/trainer.py") == "ppo" and walk.package("__init__.py") == ""


def test_measures_count_files_changes_and_returns():
    m = walk.measures(["ppo/a.py", "ppo/a.py", "optim/b.py", "ppo/a.py", "memory/c.py"])
    assert (m["files"], m["packages"], m["changes"], m["returns"]) == (3, 3, 3, 1)


def test_the_readme_table_is_the_stored_walks():
    """Each row of benchmarks/house/README.md's table is its commit's stored walk, rule by rule."""
    import json
    import re

    folder = walk.Path(walk.__file__).parent
    rows, commit = [], None
    for line in (folder / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[1] not in walk.RULES:
            continue
        if cells[0]:
            words = cells[0].split()
            commit = f"after_{words[1]}" if words[0] == "after" else words[0]
        rows.append((commit, cells))
    assert len(rows) == 14, rows
    for commit, (_, rule, files, packages, changes, returns, step) in rows:
        stored = json.loads((folder / "results" / "cpu" / f"walk_{commit}.json").read_text())[rule]
        u, s = stored["update"], stored["optimizer_step"]
        assert [int(files), int(packages), int(changes), int(returns)] == [
            u["files"],
            u["packages"],
            u["changes"],
            u["returns"],
        ], (commit, rule)
        assert [int(n) for n in re.findall(r"\d+", step)] == [s["files"], s["changes"]], (commit, rule)
