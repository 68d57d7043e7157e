"""What machine and software a benchmark ran on, and the command that ran it (stored with every result)."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

# distribution names whose versions a result records when they are installed
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "trl",
    "peft",
    "datasets",
    "bitsandbytes",
    "liger-kernel",
    "torchao",
    "deepspeed",
    "rapidfire_hf",
)
# environment variables that change what a run measures
VARIABLES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "TRL112_PATH")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def code_digest(roots) -> str:
    """SHA-256 over the relative path and bytes of every ``.py`` / ``.sh`` / ``.yaml`` file under ``roots``
    (sorted), so a stored result names the exact library and harness code it ran, also on a machine whose
    copy of the checkout has no ``.git``."""
    h = hashlib.sha256()
    for root in map(Path, roots):
        files = sorted(f for f in root.rglob("*") if f.suffix in (".py", ".sh", ".yaml") and f.is_file())
        for f in files:
            h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _code_roots() -> list[Path]:
    import rapidfire_hf

    return [Path(rapidfire_hf.__file__).resolve().parent, Path(__file__).resolve().parents[1]]


def environment(device=None, packages=PACKAGES, **extra) -> dict:
    """GPU name and capability (of ``device``, default the current CUDA device; ``None`` on the CPU),
    package versions, Python, UTC date, the command line, the digest of the library and benchmark code
    (``code_sha256``, see :func:`code_digest`) and the variables of ``VARIABLES`` that are set.

    ``extra`` entries are added as given (for example ``smoke=True``). ``torch``'s version is read from the
    imported module, since a ``--target`` install can shadow the distribution metadata."""
    import torch

    env: dict = {"gpu": None, "capability": None}
    if torch.cuda.is_available() and getattr(device, "type", device) in (None, "cuda"):
        index = device if isinstance(device, torch.device) else torch.cuda.current_device()
        env["gpu"] = torch.cuda.get_device_name(index)
        env["capability"] = list(torch.cuda.get_device_capability(index))
    env["cuda"] = torch.version.cuda
    for name in packages:
        version = torch.__version__ if name == "torch" else _version(name)
        if version is not None:
            env[name.replace("-", "_")] = version
    env["python"] = platform.python_version()
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    env["code_sha256"] = code_digest(_code_roots())  # rapidfire_hf's package and benchmarks/
    env.update({k.lower(): os.environ[k] for k in VARIABLES if k in os.environ})
    env.update(extra)
    return env


def cuda_or_smoke(smoke: bool, hint: str = "") -> bool | None:
    """Whether a benchmark runs on CUDA (False for ``--smoke``); None, after saying so on stderr, when there
    is no CUDA device and no ``--smoke`` (the caller exits with status 2)."""
    import torch

    if smoke:
        return False
    if torch.cuda.is_available():
        return True
    print(f"no CUDA device: run with --smoke{hint}", file=sys.stderr)
    return None
