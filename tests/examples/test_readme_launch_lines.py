"""README.md's "More than one GPU" commands as far as a CPU machine can take them: each names an accelerate
config that exists and parses as YAML, the script it launches exists, and the script's own parser takes the
arguments as written (running them needs several GPUs; examples/ppo.py itself runs under DDP on CPU in
tests/examples/test_example_ppo.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from tests.examples.test_example_ppo import example  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```bash\n", readme.index("### More than one GPU")) + len("```bash\n")
    text = readme[start : readme.index("```", start)].replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.strip()]


def test_the_launch_lines_parse_as_written(example, monkeypatch):  # noqa: F811
    commands = _commands()
    assert len(commands) == 2
    monkeypatch.chdir(ROOT)  # the README's paths are the checkout's
    for words in commands:
        assert words[:2] == ["accelerate", "launch"], words
        config = ROOT / words[words.index("--config_file") + 1]
        assert isinstance(yaml.safe_load(config.read_text()), dict), config
        script = next(w for w in words if w.endswith(".py"))
        assert script == "examples/ppo.py" and (ROOT / script).is_file()
        script_args, args = example.parse_args(words[words.index(script) + 1 :])
        assert args.output_dir, words
        if "--sync-interval" in words:
            assert script_args.sync_interval == int(words[words.index("--sync-interval") + 1])
        if "--rapidfire_config" in words:
            assert args.rapidfire_config == words[words.index("--rapidfire_config") + 1]
