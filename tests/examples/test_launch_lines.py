"""The `accelerate launch` commands of README.md ("More than one GPU") and docs/distributed.md, as far as a CPU
machine can take them: accelerate's own parser takes the launcher's flags, the config named exists and parses
as YAML, and examples/ppo.py's parser takes the script's arguments as written (running them needs several
GPUs; examples/ppo.py itself runs under DDP on CPU in tests/examples/test_example_ppo.py). A `...` in place
of the script's arguments is left unparsed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from accelerate.commands.launch import launch_command_parser

from tests.examples.test_example_ppo import example  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def _launches(text: str) -> list[list[str]]:
    """Each `accelerate launch` command of ``text``'s bash blocks, as words after `accelerate launch`."""
    out = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0]:  # VAR=value before the command
                words = words[1:]
            if words[:2] == ["accelerate", "launch"]:
                out.append(words[2:])
    return out


def _readme() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### More than one GPU")
    return readme[start : readme.index("\n## ", start)]


COMMANDS = [("README.md", w) for w in _launches(_readme())] + [
    ("docs/distributed.md", w) for w in _launches((ROOT / "docs" / "distributed.md").read_text())
]


def test_the_commands_are_found():
    assert sum(src == "README.md" for src, _ in COMMANDS) == 2
    assert sum(src == "docs/distributed.md" for src, _ in COMMANDS) == 5


@pytest.mark.parametrize(("source", "words"), COMMANDS, ids=[f"{s}:{' '.join(w)[:60]}" for s, w in COMMANDS])
def test_the_launch_line_parses_as_written(source, words, example, monkeypatch):  # noqa: F811
    monkeypatch.chdir(ROOT)  # the commands' paths are the checkout's
    launch = launch_command_parser().parse_args(words)
    assert isinstance(yaml.safe_load(Path(launch.config_file).read_text()), dict), launch.config_file
    assert launch.training_script == "examples/ppo.py" and Path(launch.training_script).is_file()
    if launch.training_script_args == ["..."]:
        return
    script, args = example.parse_args(launch.training_script_args)
    for flag, value in zip(launch.training_script_args, launch.training_script_args[1:]):
        if flag == "--sync-interval":
            assert script.sync_interval == int(value)
        if flag == "--rapidfire_config":
            assert args.rapidfire_config == value
        if flag == "--output_dir":
            assert args.output_dir == value
