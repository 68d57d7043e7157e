"""README.md's Quickstart names what exists, and its CLI block ("Configuration and CLI") runs as written,
each `rapidfire ...` line from the checkout root. The `rapidfire plan` and `rapidfire sweep ... --plan`
lines run in their own tests (tests/cli/test_plan.py, tests/sweep/test_cli.py); the monitor line watches a
process that registered a telemetry stream, with that process's pid in place of the README's 12345 and
`--once` so that it returns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rapidfire_hf.cli.main import main
from tests.cli.test_cli_errors import watched  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]
RUN_ELSEWHERE = {"plan": "tests/cli/test_plan.py", "sweep": "tests/sweep/test_cli.py"}


def _block() -> list[list[str]]:
    """The arguments of each line of README's CLI block, comments dropped."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```bash\n", readme.index("### Configuration and CLI")) + len("```bash\n")
    lines = readme[start : readme.index("```", start)].splitlines()
    assert all(line.startswith("rapidfire ") for line in lines), lines
    return [line.split("#")[0].split()[1:] for line in lines]


def test_every_line_of_the_block_is_run_by_a_test():
    for name, path in RUN_ELSEWHERE.items():
        assert f'startswith("rapidfire {name} ")' in (ROOT / path).read_text(), path
    assert {args[0] for args in _block()} == {"config", "env", "bench", "monitor", *RUN_ELSEWHERE}


@pytest.mark.parametrize(
    "args", [a for a in _block() if a[0] in ("config", "env", "bench")], ids=lambda a: " ".join(a)
)
def test_the_line_runs_as_written(args, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # `config/advanced.yaml` is the checkout's file
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.strip(), args


def test_the_monitor_line_watches_a_training_process(watched, capsys, monkeypatch):  # noqa: F811
    pid, env = watched
    (args,) = [a for a in _block() if a[0] == "monitor"]
    assert args[args.index("--pid") + 1] == "12345"
    args[args.index("--pid") + 1] = str(pid)
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", env["RAPIDFIRE_CACHE_DIR"])
    assert main([*args, "--once"]) == 0
    assert str(pid) in capsys.readouterr().out


def test_the_quickstart_names_what_exists():
    """README's Quickstart: the console script, the `test` extra, the `slow` marker and the demo's flags it
    names exist (the demo itself runs in tests/cli/test_demo.py; pip is not run here)."""
    from rapidfire_hf.cli.main import build_parser

    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quickstart")
    text = readme[start : readme.index("\n## ", start + 1)]
    block = text[text.index("```bash\n") + len("```bash\n") : text.index("```", text.index("```bash\n") + 8)]
    first, second = block.splitlines()
    assert first == "pip install -e . && rapidfire demo"
    extra = re.fullmatch(r'pip install -e "\.\[(\w+)\]" && python -m pytest -q', second)
    assert extra, second
    project = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    scripts = project[project.index("[project.scripts]") :]
    assert scripts.split("\n")[1] == 'rapidfire = "rapidfire_hf.cli.main:main"'
    extras = project[project.index("[project.optional-dependencies]") : project.index("[project.scripts]")]
    assert re.search(rf"^{extra[1]} = \[", extras, re.M), extra[1]
    assert '`python -m pytest -q -m "not slow"`' in text and '"slow: ' in project
    flags = "`--steps`, `--output-dir`,\n`--config FILE|PRESET` and `--model PATH`"
    assert flags in text
    parsed = build_parser().parse_args(
        ["demo", "--steps", "3", "--output-dir", "out", "--config", "balanced", "--model", "path"]
    )
    assert (parsed.steps, parsed.output_dir, parsed.config, parsed.model) == (3, "out", "balanced", "path")
