"""``rapidfire env``: the versions, devices and settings to paste into a bug report.

Examples::

    rapidfire env           # text, one "- name: value" line per item
    rapidfire env --json    # the same as JSON
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from typing import Any

from rapidfire_hf.cli.json_output import JsonStdout
from rapidfire_hf.utils.units import GIB

# packages rapidfire_hf needs, by distribution name
CORE_PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets")
# optional packages, by import name
OPTIONAL_PACKAGES = (
    "wandb",
    "bitsandbytes",
    "deepspeed",
    "liger_kernel",
    "torchao",
    "triton",
    "pynvml",
    "vllm",
)
# environment variables that change how a run behaves, shown when set
SETTINGS_PREFIXES = (
    "RAPIDFIRE_",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
    "ACCELERATE_",
)
DESCRIPTION = "Print the versions, devices and settings to paste into a bug report."


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``rapidfire env``."""
    parser = subparsers.add_parser(
        "env", help="print versions and devices for a bug report", description=DESCRIPTION
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=env_command)
    return parser


def env_command(args: argparse.Namespace) -> int:
    """Print :func:`collect_env` as text or JSON."""
    if not args.json:
        print(format_env(collect_env()))
        return 0
    with JsonStdout() as out:  # what the libraries print as they are imported goes to stderr
        out.emit(collect_env())
    return 0


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _optional_version(module: str, distributions: dict[str, list[str]]) -> str:
    """ "<version>" (or "installed") when ``module`` can be imported, else "not installed"."""
    from rapidfire_hf.utils.imports import is_available

    if not is_available(module):
        return "not installed"
    for dist in distributions.get(module, [module]):
        version = _version(dist)
        if version:
            return version
    return "installed"


def _memory() -> dict[str, float | None]:
    """Total and available system memory in GiB (None where it cannot be read)."""
    try:
        import psutil

        mem = psutil.virtual_memory()
        return {"total_gib": round(mem.total / GIB, 1), "available_gib": round(mem.available / GIB, 1)}
    except ImportError:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
        total = pages * os.sysconf("SC_PAGE_SIZE") / GIB if pages else None
        return {"total_gib": round(total, 1) if total else None, "available_gib": None}


def _torch_info() -> dict[str, Any]:
    """Torch build, accelerator and device names."""
    try:
        import torch
    except ImportError:
        return {"installed": False}
    info: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                f"cuda:{index} {props.name} ({props.total_memory / GIB:.0f} GiB, sm_{props.major}{props.minor})"
            )
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        info["devices"].append("mps")
    return info


def collect_env() -> dict[str, Any]:
    """Everything ``rapidfire env`` reports, as JSON-friendly data."""
    from rapidfire_hf import __version__

    distributions = metadata.packages_distributions()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "rapidfire_hf": __version__,
        "python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(affinity) if affinity is not None else os.cpu_count(),
        "memory": _memory(),
        "torch": _torch_info(),
        "packages": {name: _version(name) or "not installed" for name in CORE_PACKAGES},
        "optional": {name: _optional_version(name, distributions) for name in OPTIONAL_PACKAGES},
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS_PREFIXES)},
    }


def format_env(info: dict[str, Any]) -> str:
    """Render :func:`collect_env` as ``- name: value`` lines, nested items indented."""
    lines = ["Copy-and-paste the text below in your GitHub issue.", ""]
    lines += _format_items(info, indent=0)
    return "\n".join(lines)


def _format_items(items: dict[str, Any], indent: int) -> list[str]:
    pad = "  " * indent
    lines = []
    for key, value in items.items():
        if isinstance(value, dict):
            lines.append(f"{pad}- {key}:" + ("" if value else " (none)"))
            lines += _format_items(value, indent + 1)
        elif isinstance(value, list):
            lines.append(f"{pad}- {key}: {', '.join(map(str, value)) or 'none'}")
        else:
            lines.append(f"{pad}- {key}: {value}")
    return lines
