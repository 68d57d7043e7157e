"""benchmarks/house/stats.py: each counter on a scratch tree whose numbers are known, its refusals, and the
house README's "Static numbers" table tied to the stored results."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.benchmarks.loader import load_benchmark

stats = load_benchmark("house/stats.py")
HOUSE = Path(stats.__file__).parent
RESULTS = HOUSE / "results" / "cpu"

FILES = {
    "ppo/__init__.py": "from rapidfire_hf.ppo.recipe.trainer import PPOTrainer\n",
    "ppo/recipe/__init__.py": "",
    "ppo/recipe/trainer.py": """
        class PPOTrainer:
            def _helper(self, trainer):  # inside PPOTrainer: not counted
                trainer.x = 1
    """,
    "ppo/config.py": """
        class PPOConfig:
            kl_coef: float = 0.05
            cliprange: float = 0.2
            cliprange_value: float = 0.2  # another knob: not cliprange
    """,
    "ppo/core.py": """
        def loss(ratio, kl, kl_coef, cliprange):
            return kl_coef * kl + ratio.clamp(1 - cliprange, 1 + cliprange)
        def helper(): ...
        def _private(): ...
    """,
    "ppo/scoring.py": "def score(args, kl):\n    return loss(1, kl, kl_coef=args.kl_coef, cliprange=0.2)\n",
    "ppo/planning.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from rapidfire_hf.ppo.recipe.trainer import PPOTrainer
        def plan_run(trainer):
            trainer.plan = 1
        def measure(t: "PPOTrainer"):
            return t.plan
        def probe(*, owner: PPOTrainer | None = None):
            owner.calls += 1
        def pair(trainer, other):
            trainer.a, other.b = 1, 2
        def reads(trainer):
            trainer.x.y = 1  # onto something it holds, not onto the trainer
        class Prefetch:
            def __init__(self, trainer):
                self.trainer = trainer
            def install(self, trainer):
                setattr(trainer, "prefetch", self)
    """,
    "sweep/fields.py": 'TUNABLE = {"kl_coef": float, "cliprange": float}\n',
    "sweep/run.py": """
        from rapidfire_hf.ppo.core import loss, helper, _private
        import rapidfire_hf.ppo.config
        def run():
            from rapidfire_hf.ppo.recipe.trainer import PPOTrainer
            return PPOTrainer
    """,
    "optim/spans.py": "class SpanMixin: ...\n",
    "optim/optimizer.py": """
        from torch.optim import Optimizer
        from rapidfire_hf.optim.spans import SpanMixin
        class Opt(SpanMixin, Optimizer): ...
    """,
    "precision/plugin.py": """
        from typing import Generic, Protocol, TypeVar
        T = TypeVar("T")
        class RuleEngine: ...
        class PluginState(Generic[T]): ...
        class Plugin(RuleEngine, PluginState[T]): ...
        class Observer(Protocol): ...
        class Probe(RuleEngine, Observer, Generic[T]): ...
    """,
    "rollout/cache.py": """
        from transformers.cache_utils import CacheLayerMixin
        class Slot(CacheLayerMixin): ...
    """,
    "memory/levels.py": """
        class Target:
            def __init__(self, name, share): ...
        LEVELS = {t.name: t for t in (Target("conservative", 0.8), Target("balanced", 0.85))}
        NAMES = tuple(LEVELS)
        def target(level):
            return LEVELS[level]
    """,
    "memory/callback.py": """
        INTERVAL = {"conservative": 50, "balanced": 20, "aggressive": 5, "auto": 20}
        SLOWER = {n: k * 2 for n, k in INTERVAL.items()}
    """,
    "memory/planner.py": "from rapidfire_hf.memory.levels import target\nSHARE = target('balanced')\n",
    "memory/checkpointing.py": "def policy(level):\n    return None if level == 'conservative' else 'all'\n",
    "config/presets.py": """
        PRESETS = {"conservative": {"pipeline": False}, "balanced": {"pipeline": True}}
        ABOUT = {"conservative": "closest to stock", "balanced": "for most runs"}
        def attention(mode):
            return mode == "auto"  # "auto" is every option's word: not a level
    """,
    "rollout/order.py": "NAMES = ('a', 'b')  # same name as memory/levels.py's, not a table\nSLOWER = 1\n",
    "utils/table.py": "def rows():\n    from rapidfire_hf.memory.levels import LEVELS\n    return LEVELS\n",
}


def scratch(tmp_path: Path, files: dict[str, str] = FILES) -> Path:
    pkg = tmp_path / "src" / "rapidfire_hf"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    for folder in {p.parent for p in pkg.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return tmp_path / "src"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return stats.measure(scratch(tmp_path_factory.mktemp("house")))


def test_sweep_to_ppo_counts_lines_names_modules_and_the_recipe_lazy_imports_too(measured):
    s = measured["sweep_ppo"]
    assert (s["import_lines"], s["lazy_import_lines"]) == (3, 1)
    assert s["name_list"] == ["PPOTrainer", "_private", "helper", "loss"]
    assert s["module_list"] == [
        "rapidfire_hf.ppo.config",
        "rapidfire_hf.ppo.core",
        "rapidfire_hf.ppo.recipe.trainer",
    ]
    assert s["recipe_modules_imported"] == ["rapidfire_hf.ppo.recipe.trainer"]  # the lazy import


def test_the_old_recipe_is_the_modules_that_moved_into_ppo_recipe(tmp_path):
    files = {k: v for k, v in FILES.items() if not k.startswith("ppo/recipe")}
    files["ppo/__init__.py"] = "from rapidfire_hf.ppo.trainer import PPOTrainer\n"
    files["ppo/trainer.py"] = files["ppo/setup.py"] = "class PPOTrainer: ...\n"
    files["sweep/run.py"] = (
        "def run():\n    from rapidfire_hf.ppo.setup import x\n    from rapidfire_hf.ppo import core\n"
    )
    s = stats.measure(scratch(tmp_path, files))["sweep_ppo"]
    assert s["recipe_modules_imported"] == ["rapidfire_hf.ppo", "rapidfire_hf.ppo.setup"]  # ppo/__init__ too
    assert (s["import_lines"], s["lazy_import_lines"], s["modules"]) == (2, 2, 3)


def test_functions_taking_the_trainer_by_name_or_annotation_and_those_writing_onto_it(measured):
    t = measured["trainer_takers"]
    got = {f["function"]: (f["params"], f["writes"]) for f in t["list"]}
    assert got == {
        "plan_run": (["trainer"], True),
        "measure": (["t"], False),  # annotated "PPOTrainer" (a string)
        "probe": (["owner"], True),  # annotated PPOTrainer | None, keyword-only, +=
        "pair": (["trainer"], True),  # a tuple target
        "reads": (["trainer"], False),
        "Prefetch.__init__": (["trainer"], False),
        "Prefetch.install": (["trainer"], True),  # setattr
    }
    assert (t["functions"], t["writing"], t["per_package"]) == (7, 4, {"ppo": 7})


def test_mixins_are_mixin_bases_or_two_bases_of_ours_not_protocols_or_generic(measured):
    m = measured["mixins"]
    assert [(c["file"], c["class"]) for c in m["list"]] == [
        ("optim/optimizer.py", "Opt"),
        ("precision/plugin.py", "Plugin"),  # PluginState[T] is ours; Generic is not
    ]
    assert m["classes"] == 2 and m["mixins_defined"] == ["optim/spans.py:SpanMixin"]
    assert [c["class"] for c in m["library_mixin_bases"]] == ["Slot"]


def test_the_largest_files_by_newlines(measured):
    big = measured["largest"]
    assert [f["file"] for f in big["files"]] == [
        "ppo/planning.py", "precision/plugin.py", "memory/levels.py", "sweep/run.py", "config/presets.py"
    ]  # fmt: skip
    assert [f["lines"] for f in big["files"]] == [18, 7, 6, 5, 4]
    # + the package's __init__.py and those of the 7 folders without one in FILES
    assert (big["lines"], big["src_files"]) == (40, len(FILES) + 8)


def test_knob_reach_names_each_file_and_how(measured):
    k = measured["knobs"]
    assert k["kl_coef"]["by_file"] == {
        "ppo/config.py": ["name"],
        "ppo/core.py": ["name", "parameter"],
        "ppo/scoring.py": ["attribute", "keyword"],
        "sweep/fields.py": ["string"],
    }
    assert k["cliprange"]["files"] == 4 and "ppo/scoring.py" in k["cliprange"]["by_file"]  # cliprange=0.2


def test_memory_level_reach_follows_the_tables_and_the_comparisons(measured):
    m = measured["knobs"]["memory_level"]
    assert m["tables"] == {
        "INTERVAL": "memory/callback.py",
        "LEVELS": "memory/levels.py",
        "SLOWER": "memory/callback.py",  # built from a table
        "target": "memory/levels.py",  # returns an entry of one
    }  # not NAMES (the names alone), PRESETS, ABOUT (settings and sentences, not numbers)
    assert m["spelled"] == ["memory/callback.py", "memory/levels.py"]
    assert m["by_file"] == {
        "memory/callback.py": ["table: INTERVAL, SLOWER"],
        "memory/checkpointing.py": ["compares to a level name"],
        "memory/levels.py": ["table: LEVELS, target"],
        "memory/planner.py": ["table: target"],
        "utils/table.py": ["table: LEVELS"],
    }  # not rollout/order.py (its own SLOWER), not config/presets.py (compares to "auto")


def test_the_import_contract_rules_apply_to_the_tree(measured):
    c = measured["contract"]
    assert c["upward_list"] == ["utils/table.py -> rapidfire_hf.memory.levels"]
    assert c["private_list"] == ["sweep/run.py -> rapidfire_hf.ppo.core._private"]


def test_the_cli_writes_json_naming_the_commit(tmp_path, capsys):
    out = tmp_path / "stats.json"
    result = stats.main(["--src", str(scratch(tmp_path)), "--commit", "scratch", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["commit"] == "scratch" and len(result["src_sha256"]) == 64
    assert "[scratch] mixins: 2 (Opt, Plugin)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--src", "{tmp}/nowhere"], "not a folder"),
        (["--src", "{tmp}"], "no rapidfire_hf/__init__.py under it"),
        (["--src", "{tmp}/src"], "cannot parse"),
        (["--rev", "no-such-commit"], "--rev no-such-commit"),
    ],
)
def test_refusals_name_the_problem(tmp_path, argv, message):
    scratch(tmp_path, {"ppo/broken.py": "def f(:\n"})
    with pytest.raises(SystemExit, match=re.escape(message)):
        stats.main([a.format(tmp=tmp_path) for a in argv])


# ---- the README's table and the stored results ---------------------------------------------------------
ROWS = {
    "sweep → ppo: import statements (lazy)": lambda d: [d["sweep_ppo"]["import_lines"], d["sweep_ppo"]["lazy_import_lines"]],
    "sweep → ppo: names / modules / recipe modules": lambda d: [
        d["sweep_ppo"]["names"], d["sweep_ppo"]["modules"], d["sweep_ppo"]["recipe_modules"]
    ],
    "functions taking the trainer (writing onto it)": lambda d: [
        d["trainer_takers"]["functions"], d["trainer_takers"]["writing"]
    ],
    "… of them in `ppo/` (writing)": lambda d: [
        d["trainer_takers"]["per_package"].get("ppo", 0), d["trainer_takers"]["writing_per_package"].get("ppo", 0)
    ],
    "mixins": lambda d: [d["mixins"]["classes"]],
    "lines of the five largest files": lambda d: [d["largest"]["lines"]],
    "src files / lines": lambda d: [d["largest"]["src_files"], d["largest"]["src_lines"]],
    "`kl_coef`: files naming it": lambda d: [d["knobs"]["kl_coef"]["files"]],
    "`cliprange`: files naming it": lambda d: [d["knobs"]["cliprange"]["files"]],
    "memory level: files reading / spelling its numbers": lambda d: [
        d["knobs"]["memory_level"]["files"], len(d["knobs"]["memory_level"]["spelled"])
    ],
    "upward imports / private names crossing packages": lambda d: [
        d["contract"]["upward_imports"], d["contract"]["private_crossings"]
    ],
}  # fmt: skip


def _numbers(cell: str) -> list[int]:
    return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", cell)]


def readme_table() -> tuple[list[str], dict[str, list[str]]]:
    lines = (HOUSE / "README.md").read_text().split("## Static numbers", 1)[1].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    header, body = rows[0], rows[2:]
    return header, {r[0]: r[1:] for r in body}


def test_the_readme_table_is_the_stored_results():
    header, rows = readme_table()
    assert set(rows) == set(ROWS), set(rows) ^ set(ROWS)
    stored = [json.loads((RESULTS / f"stats_{name}.json").read_text()) for name in ("e0ac75f", "main")]
    for column, data in zip(header[1:], stored):
        assert data["commit"] in column, (column, data["commit"])
    for label, cells in rows.items():
        for cell, data in zip(cells, stored):
            assert _numbers(cell) == ROWS[label](data), (label, cell)


@pytest.mark.slow  # two trees measured from git, about 15 s on a 2-core CPU
def test_the_readme_commands_make_the_stored_results(tmp_path):
    """Each command of the section runs (its --out sent to tmp_path) and writes its stored file exactly."""
    section = (HOUSE / "README.md").read_text().split("## Static numbers", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split() for line in block.splitlines() if line.strip()]
    assert [c[-1] for c in commands] == [
        f"benchmarks/house/results/cpu/stats_{n}.json" for n in ("e0ac75f", "main")
    ]
    for words in commands:
        assert words[:2] == ["python", "benchmarks/house/stats.py"] and words[-2] == "--out", words
        rev = words[words.index("--rev") + 1]
        known = subprocess.run(
            ["git", "-C", str(stats.ROOT), "cat-file", "-e", f"{rev}^{{commit}}"], check=False
        )
        if known.returncode:
            pytest.skip(f"commit {rev} is not in this clone")
        out = tmp_path / Path(words[-1]).name
        stats.main([*words[2:-1], str(out)])
        assert json.loads(out.read_text()) == json.loads((stats.ROOT / words[-1]).read_text()), words
