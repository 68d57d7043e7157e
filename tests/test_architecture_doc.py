"""docs/architecture.md's table of parts is the package as it is: every package of src/rapidfire_hf has its
row, every module is named in its package's row, and every module a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rapidfire_hf"
DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `([a-z_]+)/` \| (.*)$")


def parts_rows(text: str) -> dict[str, str]:
    """``{package: its row's text}`` of the table under "## The parts"."""
    section = text.split("## The parts", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in map(ROW.match, section.splitlines()) if m}


def modules_named(row: str, package: str, packages: set[str]) -> tuple[set[str], set[str]]:
    """The modules a row names: ``(its own, other packages')``. ``x.py`` and ``own/x.py`` are its own
    (``own/sub/x.py`` as ``sub/x.py``); ``other/x.py`` names another package's module."""
    own, other = set(), set()
    for path in re.findall(r"`((?:[a-z0-9_]+/)*[a-z0-9_]+\.py)`", row):
        head, _, rest = path.partition("/")
        if not rest:
            own.add(path)
        elif head == package:
            own.add(rest)
        elif head in packages:
            other.add(path)
        else:
            own.add(path)
    return own, other


def package_modules(package: Path) -> set[str]:
    """A package's modules as a row names them: ``x.py``, and ``sub/x.py`` inside a sub-folder."""
    out = set()
    for path in package.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(package)
        out.add(rel.name if rel.parent == Path(".") else f"{rel.parent.as_posix()}/{rel.name}")
    return out


def check(text: str, src: Path) -> list[str]:
    rows = parts_rows(text)
    problems = []
    packages = sorted(p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    for name in packages:
        if name not in rows:
            problems.append(f"{name}/: no row")
            continue
        have = package_modules(src / name)
        named, elsewhere = modules_named(rows[name], name, set(packages))
        for module in sorted(have):
            if module not in named and module.rsplit("/", 1)[-1] not in named:
                problems.append(f"{name}/{module}: not named in its row")
        for module in sorted(named):
            if module not in have and not any(m.endswith("/" + module) for m in have):
                problems.append(f"{name}/ row names {module}, which does not exist")
        for path in sorted(elsewhere):
            if not (src / path).exists():
                problems.append(f"{name}/ row names {path}, which does not exist")
    problems += [f"{name}/: a row for no package" for name in rows if name not in packages]
    return problems


def test_the_parts_table_names_every_package_and_module():
    assert check(DOC.read_text(), SRC) == []


def test_the_check_fails_on_a_missing_module_a_stale_name_and_a_missing_row(tmp_path):
    src = tmp_path / "pkg"
    for folder, files in {"a": ["one.py", "two.py"], "b": ["three.py"]}.items():
        (src / folder).mkdir(parents=True)
        for f in ["__init__.py", *files]:
            (src / folder / f).write_text("")
    text = (
        "## The parts\n\n| part | what |\n| --- | --- |\n"
        "| `a/` | `one.py`, `gone.py`, `b/three.py` (another part's), `b/four.py` |\n"
    )
    assert check(text, src) == [
        "a/two.py: not named in its row",
        "a/ row names gone.py, which does not exist",
        "a/ row names b/four.py, which does not exist",
        "b/: no row",
    ]
