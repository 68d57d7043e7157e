"""The import contract of ``rapidfire_hf``, read from the source with ``ast`` (nothing is imported).

1. Layers point one way: a package imports only packages of a lower layer (``LAYERS``); nothing but the
   ``python -m`` entry point imports ``cli``. ``kernels`` and ``optim`` need only torch (and triton).
2. ``sweep/`` (the many-trial recipe) uses PPO components, not ``PPOTrainer``'s recipe modules
   (``PPO_RECIPE``: the folder ``ppo/recipe/``). Inside ``ppo/`` the arrow points one way too: a component
   module (``ppo/*.py``) never imports the recipe; the recipe imports components.
3. No private name (``_x``) crosses packages, neither imported (``from m import _x``) nor read from an
   imported module (``m._x``).
4. No mixins: a class has at most one base class of ours (parts are composed, each owning its state).
5. ``benchmarks/`` and ``cli/`` read no private attribute of a trainer: they use ``PPOTrainer``'s public
   methods and its read-only view ``trainer.run_state``.

Where the code breaks a rule today, the break is listed in an allowlist below. **An allowlist may only
shrink**: the test fails when a break is added, and also when a listed break has gone from the code but
not from the list, so the lists always say exactly what is left to fix.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rapidfire_hf"
BENCHMARKS = SRC.parents[1] / "benchmarks"

# The layers, lowest first (DESIGN.md's parts, STYLE.md: "imports point one way (kernels, optim need only
# torch; integrations may import everything; nothing imports cli)"). A package may import a package of a
# strictly lower layer; packages of one layer do not import each other.
LAYERS = {
    "utils": 0,  # small shared helpers: depend on nothing else in the package
    "kernels": 1,
    "optim": 1,
    "config": 1,
    "distributed": 1,
    "demo": 1,  # the demo task's data shapes (sweep and cli build on them)
    "checkpoint": 1,  # the checkpoint writer, manifest and readers of PPOTrainer and PPOSweep
    "models": 2,  # Hugging Face model plumbing
    "memory": 3,
    "precision": 3,
    "rollout": 3,
    "ppo": 4,
    "sweep": 5,
    "integrations": 6,
    "rapidfire_hf": 7,  # the package's own __init__: the public names
    "cli": 8,
    "__main__": 9,  # ``python -m rapidfire_hf``: the only importer of cli
}

# third-party imports at module level allowed in the torch-only layers (optional ones are imported
# inside the function that needs them, which this rule leaves alone)
TORCH_ONLY = {"kernels": {"torch", "triton"}, "optim": {"torch"}}

# PPOTrainer's recipe (issue 44): the modules that put the trainer together, all in the folder ``ppo/recipe/``;
# the other modules of ``ppo/`` are the PPO components. Importing the package ``rapidfire_hf.ppo`` itself
# counts as the recipe too: its __init__ imports the trainer.
RECIPE_FOLDER = "ppo/recipe"


def recipe_modules(src: Path = SRC) -> set[str]:
    """``rapidfire_hf.ppo``, ``rapidfire_hf.ppo.recipe`` and every module under ``ppo/recipe/``."""
    found = {"rapidfire_hf.ppo", "rapidfire_hf.ppo.recipe"}
    for path in (src / RECIPE_FOLDER).rglob("*.py"):
        rel = path.relative_to(src).with_suffix("")
        found.add(".".join(["rapidfire_hf", *rel.parts]).removesuffix(".__init__"))
    return found


PPO_RECIPE = recipe_modules()

# Allowlists of today's breaks as (importing file, what it imports). They may only shrink.
UPWARD_ALLOWED: set[tuple[str, str]] = set()
SWEEP_RECIPE_ALLOWED: set[tuple[str, str]] = set()
PRIVATE_ALLOWED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    """One import of a ``rapidfire_hf`` module, as written in ``file``."""

    file: str  # relative to src/rapidfire_hf
    line: int
    module: str  # the imported module, e.g. ``rapidfire_hf.ppo.recipe.setup``
    names: tuple[str, ...]  # the names taken from it (``from m import a, b``), empty for ``import m``
    top_level: bool  # at module level (runs at import), not inside a function

    @property
    def source(self) -> str:
        return package_of(self.file)

    @property
    def target(self) -> str:
        parts = self.module.split(".")
        return parts[1] if len(parts) > 1 else "rapidfire_hf"


def package_of(file: str) -> str:
    """``ppo/recipe/setup.py`` -> ``ppo``; the package's own ``__init__.py`` -> ``rapidfire_hf``."""
    parts = Path(file).parts
    if len(parts) > 1:
        return parts[0]
    return "__main__" if parts[0] == "__main__.py" else "rapidfire_hf"


def is_module(dotted: str, src: Path) -> bool:
    """Whether ``rapidfire_hf.a.b`` names a module or package of the source tree."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (src / rel).with_suffix(".py").is_file() or (src / rel / "__init__.py").is_file()


def _resolve(node: ast.ImportFrom, file: str) -> str | None:
    if node.level == 0:
        return node.module
    base = ["rapidfire_hf", *Path(file).parts[:-1]]  # a relative import, from the file's package
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def scan(src: Path = SRC) -> tuple[list[Import], list[tuple[str, int, str]]]:
    """Every ``rapidfire_hf`` import under ``src``, and every ``module._name`` read of a module imported
    from another package, as ``(file, line, "module._name")``."""
    imports, private_reads = [], []
    for path in sorted(src.rglob("*.py")):
        file = path.relative_to(src).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        top = {id(n) for n in tree.body}
        for n in tree.body:  # imports under a module-level `if`/`try` run at import too
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(c) for c in ast.walk(n)}
        aliases: dict[str, str] = {}  # local name -> module of another package bound to it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "rapidfire_hf" or a.name.startswith("rapidfire_hf."):
                        imports.append(Import(file, node.lineno, a.name, (), id(node) in top))
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node, file)
                if module is None or not (module == "rapidfire_hf" or module.startswith("rapidfire_hf.")):
                    continue
                names = tuple(a.name for a in node.names)
                imports.append(Import(file, node.lineno, module, names, id(node) in top))
                for a in node.names:  # `from package import module`: that module is imported too
                    if is_module(f"{module}.{a.name}", src):
                        aliases[a.asname or a.name] = f"{module}.{a.name}"
                        imports.append(Import(file, node.lineno, f"{module}.{a.name}", (), id(node) in top))
        own = package_of(file)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and is_private(node.attr)
                and Import(file, 0, aliases[node.value.id], (), False).target != own
            ):
                private_reads.append((file, node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return imports, private_reads


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def upward_imports(imports: list[Import]) -> set[tuple[str, str]]:
    """Imports of a package that is not in a lower layer (``KeyError`` names a package missing from LAYERS).

    ``from rapidfire_hf import __version__`` is not one: the package's __init__ imports its public names
    lazily, so reading the version loads nothing above the importer."""
    return {
        (i.file, i.module)
        for i in imports
        if i.source != i.target
        and LAYERS[i.target] >= LAYERS[i.source]
        and not (i.module == "rapidfire_hf" and i.names == ("__version__",))
    }


def sweep_recipe_imports(imports: list[Import], recipe: set[str] = PPO_RECIPE) -> set[tuple[str, str]]:
    return {(i.file, i.module) for i in imports if i.source == "sweep" and i.module in recipe}


def is_component(file: str) -> bool:
    """A PPO component module: a file of ``ppo/`` outside ``ppo/recipe/`` (the package's __init__ is the
    public face, which imports the trainer)."""
    return file.startswith("ppo/") and not file.startswith(f"{RECIPE_FOLDER}/") and file != "ppo/__init__.py"


def component_recipe_imports(imports: list[Import], recipe: set[str] = PPO_RECIPE) -> set[tuple[str, str]]:
    """Imports of a recipe module by a component module of ``ppo/``, lazy and ``TYPE_CHECKING`` ones too."""
    return {(i.file, i.module) for i in imports if is_component(i.file) and i.module in recipe}


def private_crossings(imports: list[Import], reads: list[tuple[str, int, str]]) -> set[tuple[str, str]]:
    found = {
        (i.file, f"{i.module}.{name}")
        for i in imports
        if i.source != i.target
        for name in i.names
        if is_private(name)
    }
    return found | {(file, name) for file, _, name in reads}


def third_party_in_torch_only(src: Path = SRC) -> set[tuple[str, str]]:
    """Module-level imports of anything but the stdlib, torch (and triton) in ``kernels/`` and ``optim/``."""
    found = set()
    for package, allowed in TORCH_ONLY.items():
        for path in sorted((src / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root not in allowed and root != "rapidfire_hf" and root not in sys.stdlib_module_names:
                        found.add((path.relative_to(src).as_posix(), name))
    return found


def mixin_classes(src: Path = SRC) -> set[tuple[str, str]]:
    """Classes with more than one base class defined in the package, or named ``...Mixin`` (a library's
    own mixin, such as transformers' ``CacheLayerMixin``, is its interface to implement: allowed)."""
    trees = {
        p.relative_to(src).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in src.rglob("*.py")
    }
    ours = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    found = set()
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                if sum(b in ours for b in bases) > 1 or node.name.endswith("Mixin"):
                    found.add((file, node.name))
    return found


def trainer_private_names(src: Path = SRC) -> set[str]:
    """``PPOTrainer``'s private names: the ``self._x`` it uses and the ``_x`` methods and properties it defines."""
    tree = ast.parse((src / RECIPE_FOLDER / "trainer.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return {n for n in names if is_private(n)}


def private_trainer_reads(files: list[Path], root: Path, private: set[str]) -> set[tuple[str, str]]:
    """``x._name`` (also through ``getattr``/``setattr``/``hasattr``) in ``files``, where ``x`` is not
    ``self``/``cls`` and either ``_name`` is one of ``private`` (PPOTrainer's) or ``x`` is named ``*trainer*``."""

    def is_trainer_read(base: ast.expr, name: str) -> bool:
        if not is_private(name):
            return False
        last = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
        return last not in ("self", "cls") and (name in private or "trainer" in last.lower())

    found = set()
    for path in files:
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Attribute) and is_trainer_read(node.value, node.attr):
                found.add((rel, f"{ast.unparse(node.value)}.{node.attr}"))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_trainer_read(node.args[0], node.args[1].value)
            ):
                found.add((rel, f"{ast.unparse(node.args[0])}.{node.args[1].value}"))
    return found


def check_against(found: set[tuple[str, str]], allowed: set[tuple[str, str]], what: str, fix: str) -> None:
    """Fail on a break not in ``allowed`` and on an allowed break that is no longer in the code."""
    new = sorted(found - allowed)
    gone = sorted(allowed - found)
    message = []
    if new:
        message.append(f"{what} ({fix}):\n" + "\n".join(f"  {f} imports {m}" for f, m in new))
    if gone:
        message.append(
            f"fixed, so remove from the allowlist in tests/test_import_contract.py ({what}):\n"
            + "\n".join(f"  {f} -> {m}" for f, m in gone)
        )
    assert not message, "\n".join(message)


@pytest.fixture(scope="module")
def scanned():
    return scan()


def test_every_package_has_a_layer(scanned):
    imports, _ = scanned
    packages = {package_of(p.relative_to(SRC).as_posix()) for p in SRC.rglob("*.py")}
    packages |= {i.target for i in imports}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"packages without a layer: {missing}; add each to LAYERS in {__file__}"


def test_layers_point_one_way(scanned):
    imports, _ = scanned
    check_against(
        upward_imports(imports),
        UPWARD_ALLOWED,
        "imports of a package in the same or a higher layer",
        "move the shared piece down to the layer both can import",
    )


def test_nothing_imports_cli(scanned):
    imports, _ = scanned
    importers = sorted({i.file for i in imports if i.target == "cli" and i.source not in ("cli", "__main__")})
    assert not importers, f"cli is the top: nothing imports it, but {importers} do"


def test_kernels_and_optim_need_only_torch():
    found = third_party_in_torch_only()
    assert not found, (
        f"module-level imports beyond torch in a torch-only package (import inside the function): {sorted(found)}"
    )


def test_sweep_imports_no_ppo_trainer_recipe(scanned):
    imports, _ = scanned
    check_against(
        sweep_recipe_imports(imports),
        SWEEP_RECIPE_ALLOWED,
        "sweep/ imports PPOTrainer's recipe modules",
        "import the component from the module that defines it",
    )


def test_ppo_components_import_no_recipe_module(scanned):
    imports, _ = scanned
    assert (SRC / RECIPE_FOLDER / "trainer.py").is_file(), "PPOTrainer's recipe lives in ppo/recipe/"
    found = sorted(component_recipe_imports(imports))
    assert not found, (
        "a PPO component imports PPOTrainer's recipe (move the shared piece into a component, or the user "
        f"into ppo/recipe/): {found}"
    )


def test_no_private_name_crosses_packages(scanned):
    imports, reads = scanned
    check_against(
        private_crossings(imports, reads),
        PRIVATE_ALLOWED,
        "private names used by another package",
        "make the name public in its own module, or move the user next to it",
    )


def test_no_mixins():
    found = mixin_classes()
    assert not found, f"classes mixing in several of our classes (compose parts instead): {sorted(found)}"


def test_benchmarks_and_cli_read_no_private_trainer_attribute():
    root = SRC.parents[1]
    files = sorted([*BENCHMARKS.rglob("*.py"), *(SRC / "cli").rglob("*.py")])
    found = private_trainer_reads(files, root, trainer_private_names())
    assert not found, (
        "private trainer attributes read outside the trainer (use a public PPOTrainer method or "
        f"trainer.run_state): {sorted(found)}"
    )


# ---- the checks themselves, on a scratch tree (a contract that cannot fail protects nothing) -------------
def _scratch(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "rapidfire_hf"
    for rel, text in {"__init__.py": "", **files}.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {Path(rel).parts[0] for rel in files if len(Path(rel).parts) > 1}:
        (src / package / "__init__.py").touch()
    return src


def test_the_checks_find_each_kind_of_break(tmp_path):
    src = _scratch(
        tmp_path,
        {
            "utils/start_table.py": "def f():\n    from rapidfire_hf.memory.telemetry import cache_dir\n",
            "memory/telemetry.py": "def _private(): ...\ndef cache_dir(): ...\n",
            "optim/verification.py": "import transformers\n\ndef f():\n    import bitsandbytes\n",
            "ppo/recipe/setup.py": "from rapidfire_hf.memory.telemetry import _private\n",
            "ppo/core.py": "",
            "ppo/recipe/trainer.py": "from rapidfire_hf.ppo.core import y\n",  # recipe -> component: fine
            "ppo/optimization.py": "from rapidfire_hf.ppo.recipe.setup import x\n",  # component -> recipe
            "ppo/stepper.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .recipe import trainer\n"
            ),
            "ppo/__init__.py": "from rapidfire_hf.ppo.recipe.trainer import PPOTrainer\n",  # the public face
            "sweep/trial.py": (
                "from rapidfire_hf.ppo.recipe.setup import x\nfrom rapidfire_hf.ppo.core import y\n"
                "from rapidfire_hf.memory import telemetry\ntelemetry._private()\n"
            ),
            "sweep/phases.py": "from ..ppo.recipe import trainer\n",  # relative, to the package
            "cli/main.py": "",
            "rollout/engine.py": "from rapidfire_hf.cli.main import main\n",
            "rollout/families.py": "import rapidfire_hf\n",  # the whole package: not only its version
            "memory/probe.py": "from rapidfire_hf import __version__\n",  # the version alone: lazy
        },
    )
    imports, reads = scan(src)
    assert upward_imports(imports) == {
        ("utils/start_table.py", "rapidfire_hf.memory.telemetry"),  # lazy imports count too
        ("rollout/engine.py", "rapidfire_hf.cli.main"),
        ("rollout/families.py", "rapidfire_hf"),
    }
    recipe = recipe_modules(src)
    assert recipe == {
        "rapidfire_hf.ppo",
        "rapidfire_hf.ppo.recipe",
        "rapidfire_hf.ppo.recipe.setup",
        "rapidfire_hf.ppo.recipe.trainer",
    }
    assert sweep_recipe_imports(imports, recipe) == {
        ("sweep/trial.py", "rapidfire_hf.ppo.recipe.setup"),
        ("sweep/phases.py", "rapidfire_hf.ppo.recipe"),  # the recipe folder itself
        ("sweep/phases.py", "rapidfire_hf.ppo.recipe.trainer"),
    }
    assert component_recipe_imports(imports, recipe) == {
        ("ppo/optimization.py", "rapidfire_hf.ppo.recipe.setup"),
        ("ppo/stepper.py", "rapidfire_hf.ppo.recipe"),  # under TYPE_CHECKING: still an arrow up
        ("ppo/stepper.py", "rapidfire_hf.ppo.recipe.trainer"),
    }
    assert private_crossings(imports, reads) == {
        ("ppo/recipe/setup.py", "rapidfire_hf.memory.telemetry._private"),
        ("sweep/trial.py", "rapidfire_hf.memory.telemetry._private"),
    }
    assert third_party_in_torch_only(src) == {("optim/verification.py", "transformers")}


def test_the_mixin_check_finds_two_bases_of_ours(tmp_path):
    src = _scratch(
        tmp_path,
        {
            "precision/rules.py": "class RuleEngine: ...\nclass PluginState: ...\n",
            "precision/plugin.py": "class AdaptivePrecisionPlugin(RuleEngine, PluginState): ...\n",
            "optim/spans.py": "class SpanMixin: ...\n",
            "rollout/cache.py": "from transformers.cache_utils import CacheLayerMixin\nclass Slot(CacheLayerMixin): ...\n",
            "checkpoint/errors.py": "class CheckpointError(Exception): ...\nclass SaveError(CheckpointError, OSError): ...\n",
        },
    )
    assert mixin_classes(src) == {
        ("precision/plugin.py", "AdaptivePrecisionPlugin"),
        ("optim/spans.py", "SpanMixin"),
    }


def test_an_allowlist_fails_on_a_new_break_and_on_a_stale_entry():
    allowed = {("sweep/trial.py", "rapidfire_hf.ppo.recipe.setup")}
    check_against(
        {("sweep/trial.py", "rapidfire_hf.ppo.recipe.setup")}, allowed, "x", "y"
    )  # as listed: passes
    with pytest.raises(AssertionError, match="sweep/sweep.py imports rapidfire_hf.ppo.recipe.trainer"):
        check_against(allowed | {("sweep/sweep.py", "rapidfire_hf.ppo.recipe.trainer")}, allowed, "x", "y")
    with pytest.raises(AssertionError, match="remove from the allowlist"):
        check_against(set(), allowed, "x", "y")


def test_the_private_trainer_read_check_finds_each_kind(tmp_path):
    src = _scratch(
        tmp_path,
        {
            "ppo/recipe/trainer.py": (
                "class PPOTrainer:\n    def __init__(self):\n        self._oom = 0\n        self.plan = None\n"
                "    @property\n    def _engine(self): ...\n    def one_update(self): ...\n"
            ),
        },
    )
    assert trainer_private_names(src) == {"_oom", "_engine"}
    bench = tmp_path / "bench.py"
    bench.write_text(
        "x = trainer._oom\n"  # a private attribute of the trainer
        "y = getattr(t._engine, 'backend', None)\n"  # a private name of PPOTrainer, on any object
        "z = getattr(my_trainer, '_other', 0)\n"  # any private attribute of something named *trainer*
        "self._engine = 1\n"  # its own attribute: not a read of the trainer's
        "ok = (trainer.run_state.oom_splits, trainer.one_update(0), engine._static, self.trainer.plan)\n"
    )
    assert private_trainer_reads([bench], tmp_path, trainer_private_names(src)) == {
        ("bench.py", "trainer._oom"),
        ("bench.py", "t._engine"),
        ("bench.py", "my_trainer._other"),
    }
