"""Static numbers of a rapidfire_hf source tree (issue 44's before/after), read with ``ast`` (nothing is
imported from the measured tree).

- ``sweep_ppo``: the import lines in ``sweep/`` that import from ``rapidfire_hf.ppo`` or one of its
  modules (lazy imports inside functions too), the distinct names imported, the distinct ``ppo`` modules
  and how many of those are PPOTrainer's recipe. The recipe is ``ppo/recipe/`` and the package
  ``rapidfire_hf.ppo`` itself (``tests/test_import_contract.py``'s ``recipe_modules``); a tree without that
  folder (e0ac75f) is read with ``OLD_RECIPE``: the modules that later moved into it.
- ``trainer_takers``: functions and methods, outside the ``PPOTrainer`` class, with a parameter named
  ``trainer`` or annotated with ``PPOTrainer``; per package; and those that write onto it
  (``trainer.x = ...``, ``trainer.x += ...``, ``setattr(trainer, ...)``).
- ``mixins``: classes with a base named ``*Mixin`` defined in the tree, or with two or more bases defined in
  the tree that are not Protocols; a library's own ``*Mixin`` base (transformers' ``CacheLayerMixin``: its
  interface to implement) is listed apart, as the import contract allows it.
- ``largest``: the five largest ``.py`` files by lines (``wc -l``: newline characters).
- ``knobs``: for ``kl_coef`` and ``cliprange``, the files that name the knob: an attribute ``x.kl_coef``, a
  name or parameter ``kl_coef``, a keyword ``kl_coef=``, or the string ``"kl_coef"`` exactly (a mapping's
  key, ``getattr``). For a memory level (``memory/levels.py``: what each ``memory.optimization`` level lets
  a run do), the files that read a level's numbers: they name a per-level table (a dict keyed by at least
  two level names whose values are numbers, booleans, None, one-word strings or calls; a dict built from
  such a table; a name bound to one) or a function returning an entry of one (``level_target``), or they
  compare a value to a level name (``level == "conservative"``); ``spelled``: the files where a level's
  numbers are written (a per-level dict literal).
- ``contract``: the import contract's own checks (tests/test_import_contract.py, loaded from this
  checkout and run on the measured tree): imports of a package in the same or a higher layer, and private
  names crossing packages.

Usage::

    python benchmarks/house/stats.py --out stats.json                # the checkout's src/
    python benchmarks/house/stats.py --rev e0ac75f --out stats.json  # a commit's src/ (git archive)
    python benchmarks/house/stats.py --src /path/to/src --commit NAME --out stats.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common.env import code_digest  # noqa: E402
from benchmarks.common.results import write_json  # noqa: E402

CONTRACT_FILE = ROOT / "tests" / "test_import_contract.py"
# PPOTrainer's recipe at e0ac75f, before ppo/recipe/ existed: the modules of ppo/ that moved into it
OLD_RECIPE = ("trainer", "setup", "planning", "checkpoint", "start_report", "memory_options", "export")
KNOBS = ("kl_coef", "cliprange")
# the memory.optimization levels (config's MemoryLevel; the same four words at both commits)
LEVEL_NAMES = frozenset({"conservative", "balanced", "aggressive", "auto"})
# the names a comparison counts: "auto" is also an attention, precision, dtype, ... value everywhere
COMPARED_LEVELS = LEVEL_NAMES - {"auto"}
TRAINER_CLASS = "PPOTrainer"


def contract():
    """tests/test_import_contract.py of this checkout, as a module (its rules, applied to any tree)."""
    name = "house_import_contract"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CONTRACT_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass needs its module registered
        spec.loader.exec_module(module)
    return sys.modules[name]


def parse(pkg: Path) -> dict[str, ast.Module]:
    """Every ``.py`` file under the package folder ``pkg`` (``.../src/rapidfire_hf``), parsed, by relative path."""
    return {
        p.relative_to(pkg).as_posix(): ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
        for p in sorted(pkg.rglob("*.py"))
    }


def package_of(file: str) -> str:
    """``ppo/recipe/setup.py`` -> ``ppo``; a top-level file -> ``rapidfire_hf``."""
    return file.split("/")[0] if "/" in file else "rapidfire_hf"


# ---- sweep -> ppo ------------------------------------------------------------------------------------------
def in_ppo(module: str) -> bool:
    return module == "rapidfire_hf.ppo" or module.startswith("rapidfire_hf.ppo.")


def recipe_of(pkg: Path, rules) -> set[str]:
    if (pkg / "ppo" / "recipe").is_dir():
        return rules.recipe_modules(pkg)
    return {"rapidfire_hf.ppo", *(f"rapidfire_hf.ppo.{m}" for m in OLD_RECIPE)}


def sweep_ppo(imports, recipe: set[str]) -> dict:
    """``imports``: the contract's ``scan`` records (one per module a line imports: ``from rapidfire_hf.ppo
    import core`` is a record of ``rapidfire_hf.ppo`` and one of ``rapidfire_hf.ppo.core``)."""
    mine = [i for i in imports if package_of(i.file) == "sweep" and in_ppo(i.module)]
    lines = {(i.file, i.line) for i in mine}
    lazy = {(i.file, i.line) for i in mine if not i.top_level}
    names = sorted({n for i in mine for n in i.names})
    modules = sorted({i.module for i in mine})
    recipe_hit = sorted(m for m in modules if m in recipe)
    return {
        "import_lines": len(lines),
        "lazy_import_lines": len(lazy),
        "names": len(names),
        "modules": len(modules),
        "recipe_modules": len(recipe_hit),
        "recipe_modules_imported": recipe_hit,
        "recipe_rule": sorted(recipe),
        "module_list": modules,
        "name_list": names,
        "lines": [f"{f}:{n}" for f, n in sorted(lines)],
    }


# ---- functions taking the trainer ------------------------------------------------------------------------
def _takes_trainer(arg: ast.arg) -> bool:
    return arg.arg == "trainer" or (
        arg.annotation is not None and TRAINER_CLASS in ast.unparse(arg.annotation)
    )


def _writes_onto(fn: ast.AST, params: set[str]) -> bool:
    def onto(target: ast.AST) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(onto(t) for t in target.elts)
        if isinstance(target, ast.Starred):
            return onto(target.value)
        return (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id in params
        )

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(onto(t) for t in node.targets):
            return True
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and onto(node.target):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in params
        ):
            return True
    return False


def trainer_takers(trees: dict[str, ast.Module]) -> dict:
    found = []

    def visit(node: ast.AST, file: str, where: tuple[str, ...], in_trainer: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, file, (*where, child.name), in_trainer or child.name == TRAINER_CLASS)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if _takes_trainer(p)}
                if params and not in_trainer:
                    found.append(
                        {
                            "file": file,
                            "function": ".".join((*where, child.name)),
                            "params": sorted(params),
                            "writes": _writes_onto(child, params),
                        }
                    )
                visit(child, file, (*where, child.name), in_trainer)
            else:
                visit(child, file, where, in_trainer)

    for file, tree in trees.items():
        visit(tree, file, (), False)
    per_package = Counter(package_of(f["file"]) for f in found)
    writing = [f for f in found if f["writes"]]
    return {
        "functions": len(found),
        "writing": len(writing),
        "per_package": dict(sorted(per_package.items())),
        "writing_per_package": dict(sorted(Counter(package_of(f["file"]) for f in writing).items())),
        "list": found,
    }


# ---- mixins ----------------------------------------------------------------------------------------------
def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
        base = base.value
    return ast.unparse(base).split(".")[-1]


def mixins(trees: dict[str, ast.Module]) -> dict:
    classes = [(f, n) for f, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    ours = {n.name for _, n in classes}
    protocols = {n.name for _, n in classes if any(_base_name(b) == "Protocol" for b in n.bases)}
    found, library, defined = [], [], []
    for file, node in classes:
        bases = [_base_name(b) for b in node.bases]
        project = [b for b in bases if b in ours and b not in protocols and b not in ("Protocol", "Generic")]
        if node.name.endswith("Mixin"):
            defined.append(f"{file}:{node.name}")
        if any(b.endswith("Mixin") for b in project) or len(project) >= 2:
            found.append({"file": file, "class": node.name, "bases": bases})
        elif any(b.endswith("Mixin") and b not in ours for b in bases):
            library.append({"file": file, "class": node.name, "bases": bases})
    return {"classes": len(found), "list": found, "mixins_defined": defined, "library_mixin_bases": library}


# ---- the largest files -----------------------------------------------------------------------------------
def largest(pkg: Path, n: int = 5) -> dict:
    lines = {p.relative_to(pkg).as_posix(): p.read_bytes().count(b"\n") for p in pkg.rglob("*.py")}
    top = sorted(lines.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return {
        "files": [{"file": f, "lines": k} for f, k in top],
        "lines": sum(k for _, k in top),
        "src_files": len(lines),
        "src_lines": sum(lines.values()),
    }


# ---- knob reach ------------------------------------------------------------------------------------------
def knob_uses(tree: ast.AST, name: str) -> list[str]:
    """How a file names ``name``: ``attribute``, ``name``, ``parameter``, ``keyword``, ``string``."""
    kinds = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == name:
            kinds.add("attribute")
        elif isinstance(node, ast.Name) and node.id == name:
            kinds.add("name")
        elif isinstance(node, ast.arg) and node.arg == name:
            kinds.add("parameter")
        elif isinstance(node, ast.keyword) and node.arg == name:
            kinds.add("keyword")
        elif isinstance(node, ast.Constant) and node.value == name:
            kinds.add("string")
    return sorted(kinds)


def knob_reach(trees: dict[str, ast.Module], name: str) -> dict:
    by_file = {f: k for f, t in trees.items() if (k := knob_uses(t, name))}
    return {"files": len(by_file), "by_file": by_file}


def _level_value(value: ast.expr) -> bool:
    if isinstance(value, ast.Constant):
        return not isinstance(value.value, str) or value.value.isidentifier()
    return isinstance(value, ast.Call)


def is_level_table(node: ast.AST) -> bool:
    """A dict literal keyed by at least two level names, every value a level's number (a number, a bool,
    None, a one-word string such as a checkpointing policy, or a call such as ``LevelTarget(...)``)."""
    if not isinstance(node, ast.Dict) or None in node.keys:
        return False
    keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
    return (
        len(keys) == len(node.keys)
        and len(LEVEL_NAMES.intersection(keys)) >= 2
        and set(keys) <= LEVEL_NAMES
        and all(_level_value(v) for v in node.values)
    )


def is_level_record(node: ast.AST) -> bool:
    """A call spelling one level's numbers: a level name as its first argument or ``name=``, and more
    arguments (``LevelTarget("balanced", 0.85, True, ...)``)."""
    if not isinstance(node, ast.Call) or len(node.args) + len(node.keywords) < 2:
        return False
    first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
    return isinstance(first, ast.Constant) and first.value in LEVEL_NAMES


def _bound_names(tree: ast.Module) -> list[tuple[str, ast.expr]]:
    out = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            out += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.append((node.target.id, node.value))
    return out


def _names_in(node: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, (ast.Name, ast.Attribute))
    }


def level_tables(trees: dict[str, ast.Module]) -> tuple[dict[str, str], set[str]]:
    """The per-level tables and accessors of a tree (name -> defining file), and the files that spell a
    table literally.

    A table: a module-level name bound to a per-level dict literal (:func:`is_level_table`) or to a value
    holding two or more level records (:func:`is_level_record`, ``LevelTarget("balanced", 0.85, ...)``),
    to a dict comprehension over a table, or to a table (an alias); an accessor: a module-level function
    that returns a subscript of a table (``level_target``). Found to a fixed point, so a table built from a
    table counts. (``tuple(MEMORY_LEVELS)``, the names alone, is not a table: it holds no number.)"""
    tables: dict[str, str] = {}
    spelled = set()
    for file, tree in trees.items():
        for name, value in _bound_names(tree):
            nodes = list(ast.walk(value))
            if any(is_level_table(n) for n in nodes) or sum(map(is_level_record, nodes)) >= 2:
                tables[name] = file
                spelled.add(file)
    while True:
        before = len(tables)
        for file, tree in trees.items():
            for name, value in _bound_names(tree):
                if isinstance(value, (ast.DictComp, ast.Name, ast.Attribute)) and _names_in(value) & set(
                    tables
                ):
                    tables.setdefault(name, file)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and any(
                    isinstance(r, ast.Return)
                    and isinstance(r.value, ast.Subscript)
                    and _names_in(r.value.value) & set(tables)
                    for r in ast.walk(node)
                ):
                    tables.setdefault(node.name, file)
        if len(tables) == before:
            return tables, spelled


def _compares_to_level(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in COMPARED_LEVELS:
                    return True
    return False


def tables_named(file: str, tree: ast.Module, tables: dict[str, str]) -> set[str]:
    """The tables a file defines, imports by name (``from m import T``) or reads as ``m.T``; a bare name
    counts only in these ways, so another file's ``ORDER`` is not the checkpointing's ``ORDER``."""
    found = {t for t, home in tables.items() if home == file}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found |= {a.name for a in node.names if a.name in tables}
        elif isinstance(node, ast.Attribute) and node.attr in tables:
            found.add(node.attr)
    return found


def memory_level_reach(trees: dict[str, ast.Module]) -> dict:
    tables, spelled = level_tables(trees)
    by_file = {}
    for file, tree in trees.items():
        kinds = []
        named = tables_named(file, tree, tables)
        if named:
            kinds.append("table: " + ", ".join(sorted(named)))
        if _compares_to_level(tree):
            kinds.append("compares to a level name")
        if kinds:
            by_file[file] = kinds
    return {
        "files": len(by_file),
        "by_file": by_file,
        "spelled": sorted(spelled),
        "tables": {t: tables[t] for t in sorted(tables)},
    }


# ---- the import contract's checks ------------------------------------------------------------------------
def contract_breaks(pkg: Path, rules, imports, reads) -> dict:
    try:
        upward = sorted(rules.upward_imports(imports))
    except KeyError as err:
        raise SystemExit(f"{pkg}: package {err} has no layer in {CONTRACT_FILE.name}'s LAYERS") from None
    private = sorted(rules.private_crossings(imports, reads))
    return {
        "upward_imports": len(upward),
        "upward_list": [f"{f} -> {m}" for f, m in upward],
        "private_crossings": len(private),
        "private_list": [f"{f} -> {m}" for f, m in private],
        "contract_mixins": sorted(f"{f}:{c}" for f, c in rules.mixin_classes(pkg)),
    }


# ---- the whole --------------------------------------------------------------------------------------------
def measure(src: Path) -> dict:
    """Every number of a ``src`` folder (the one holding ``rapidfire_hf/``)."""
    pkg = Path(src) / "rapidfire_hf"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"{src}: no rapidfire_hf/__init__.py under it (give the src/ folder of a checkout)")
    rules = contract()
    try:
        trees = parse(pkg)
        imports, reads = rules.scan(pkg)
    except (SyntaxError, UnicodeDecodeError) as err:
        raise SystemExit(f"{src}: cannot parse {getattr(err, 'filename', '')}: {err}") from None
    return {
        "sweep_ppo": sweep_ppo(imports, recipe_of(pkg, rules)),
        "trainer_takers": trainer_takers(trees),
        "mixins": mixins(trees),
        "largest": largest(pkg),
        "knobs": {
            **{k: knob_reach(trees, k) for k in KNOBS},
            "memory_level": memory_level_reach(trees),
        },
        "contract": contract_breaks(pkg, rules, imports, reads),
    }


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def checkout_commit(src: Path) -> str:
    """HEAD of this checkout, with ``+dirty`` when ``src`` differs from it."""
    try:
        head = _git("rev-parse", "--short=7", "HEAD").decode().strip()
        dirty = _git("status", "--porcelain", "--", str(src)).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--src", type=Path, help="a src/ folder (default: this checkout's src/)")
    where.add_argument("--rev", help="a commit of this repository: its src/ is measured (git archive)")
    p.add_argument(
        "--commit", help="the commit named in the output (default: --rev, or HEAD of the checkout)"
    )
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.rev:
            try:
                full = _git("rev-parse", "--verify", f"{a.rev}^{{commit}}").decode().strip()
                data = _git("archive", "--format=tar", full, "src")
            except subprocess.CalledProcessError as err:
                raise SystemExit(f"--rev {a.rev}: {err.stderr.decode().strip()}") from None
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                # the "data" filter (refuses links and paths out of tmp) exists from Python 3.10.12 / 3.11.4
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(tmp, **safe)
            src, commit = Path(tmp) / "src", a.commit or a.rev
        else:
            src = a.src or ROOT / "src"
            if not src.is_dir():
                raise SystemExit(f"--src {src}: not a folder")
            commit = a.commit or (checkout_commit(src) if a.src is None else "unknown")
        result = {"commit": commit, "src_sha256": code_digest([src / "rapidfire_hf"]), **measure(src)}
    s, t, m = result["sweep_ppo"], result["trainer_takers"], result["mixins"]
    print(f"[{commit}] sweep -> ppo: {s['import_lines']} import lines ({s['lazy_import_lines']} lazy), "
          f"{s['names']} names, {s['modules']} modules, {s['recipe_modules']} of them the recipe")  # fmt: skip
    print(f"[{commit}] functions taking the trainer: {t['functions']} ({t['writing']} write onto it), "
          f"per package {t['per_package']}")  # fmt: skip
    print(f"[{commit}] mixins: {m['classes']} ({', '.join(c['class'] for c in m['list'])})")
    big = result["largest"]
    print(
        f"[{commit}] five largest files: {big['lines']} lines ("
        + ", ".join(f"{f['file']} {f['lines']}" for f in big["files"])
        + ")"
    )
    for name, reach in result["knobs"].items():
        print(f"[{commit}] {name}: {reach['files']} files ({', '.join(reach['by_file'])})")
    c = result["contract"]
    print(f"[{commit}] upward imports: {c['upward_imports']}, private names crossing packages: "
          f"{c['private_crossings']}")  # fmt: skip
    if a.out:
        write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
