"""Import a script from ``benchmarks/`` as a module, for the benchmarks' CPU smoke tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(relpath: str, keep_on_path: bool = False) -> ModuleType:
    """``benchmarks/<relpath>`` as a module (registered in ``sys.modules`` under a name of its own, as
    dataclasses need). Its folder is on ``sys.path`` while it runs its top level, so it can import its
    siblings; ``keep_on_path`` leaves it there for scripts that import siblings later, at call time."""
    path = BENCHMARKS / relpath
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        name = "bench_" + relpath.removesuffix(".py").replace("/", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        if added and not keep_on_path:
            sys.path.remove(folder)
