"""docs/results.md's commands of README's headline rows ("Commands" of its headline rows' section): each row
1-16 has one, the folder its comment names (`# N -> benchmarks/FOLDER`) exists, and a reproduce_h200.sh entry
it runs stores into that very folder (so the row's command, its stored files and the tests reading them
agree). The entries' own commands are checked by test_reproduce_entries.py and test_reproduce_ppo_commands.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[tuple[str, str, list[str]]]:
    """(label, folder, command words) of each commented command of the block."""
    text = (ROOT / "docs" / "results.md").read_text()
    start = text.index("```bash\n", text.index("### Commands", text.index("## README.md's headline rows")))
    lines = text[start + len("```bash\n") : text.index("```", start + len("```bash\n"))].splitlines()
    assert len(lines) % 2 == 0, "a comment line then its command"
    out = []
    for comment, command in zip(lines[::2], lines[1::2]):
        m = re.match(r"# (.+?) -> benchmarks/(\S+?)/?(?:\{[^}]*\}/)?(?: |$)", comment)
        assert m, comment
        out.append((m[1], m[2], command.split()))
    return out


def _entries() -> dict[str, str]:
    text = (ROOT / "benchmarks" / "reproduce_h200.sh").read_text()
    block = text[text.index("ENTRIES=(") : text.index("\n)\n", text.index("ENTRIES=("))]
    return {e.split("|")[0]: e.split("|")[1] for e in re.findall(r'^\s+"([^"]+)"$', block, re.M)}


def test_every_headline_row_has_its_command_and_stored_folder():
    entries = _entries()
    rows = set()
    for label, folder, words in _commands():
        if m := re.fullmatch(r"(\d+)(?:-(\d+))?", label):
            rows |= set(range(int(m[1]), int(m[2] or m[1]) + 1))
        assert (ROOT / "benchmarks" / folder).is_dir(), (label, folder)
        if words[:3] == ["bash", "benchmarks/reproduce_h200.sh", "OUT"]:
            (entry,) = words[3:]
            assert entries.get(entry) == folder, (label, entry, entries.get(entry), folder)
        else:
            script = next(w for w in words if w.startswith("benchmarks/"))
            assert (ROOT / script).is_file() and folder.startswith(script.split("/")[1] + "/"), (
                label,
                script,
            )
    assert rows == set(range(1, 17))
