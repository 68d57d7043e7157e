"""I/O fault injection: hostile pickles, damaged files, planted symlinks and kill -9 in the middle of a save.

Everything here acts on real files and real processes; nothing mocks the code under test.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
from pathlib import Path


class _Reduce:
    """Pickles as a call of ``func(*args)``: what a hostile checkpoint file carries."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def write_hostile_pickle(path: Path, witness: Path) -> None:
    """Replace ``path`` by a torch file whose unpickling runs ``touch witness`` through ``os.system``.

    The checkpoint's manifest (if any) is rewritten with the new hashes, as an attacker who forges a whole
    checkpoint would, so that only the loader's refusal to unpickle code stands in the way.
    """
    import torch

    torch.save({"state": _Reduce(os.system, f"touch {witness}")}, path)
    reseal(path)


def reseal(path: Path, **changes) -> None:
    """Rewrite the manifest of the checkpoint holding ``path`` so that it vouches for the files as they are
    now (a forger's manifest: valid form, checksum and hashes); ``changes`` replace top-level entries
    (``identity=...``, ``settings=...``)."""
    from rapidfire_hf.checkpoint.manifest import MANIFEST, write_manifest

    for folder in [Path(path), *Path(path).parents]:
        manifest = folder / MANIFEST
        if manifest.is_file():
            info = {**json.loads(manifest.read_text()), **changes}
            manifest.unlink()
            write_manifest(
                folder, info["global_step"], info["num_processes"], info["identity"], info["settings"]
            )
            return
    raise FileNotFoundError(f"no checkpoint manifest above {path}")


def forge_manifest(folder: Path, mutate) -> None:
    """Apply ``mutate(info)`` to the manifest of ``folder`` and write it back with a valid checksum, in the
    canonical form: a forger who knows the format (a path outside the folder, a changed setting)."""
    import hashlib

    from rapidfire_hf.checkpoint.manifest import MANIFEST

    path = Path(folder) / MANIFEST
    info = json.loads(path.read_text())
    mutate(info)
    body = {k: v for k, v in info.items() if k != "manifest_sha256"}

    def canon(d):
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    path.write_bytes(canon({**body, "manifest_sha256": hashlib.sha256(canon(body)).hexdigest()}))


def truncate(path: Path, fraction: float = 0.5) -> None:
    """Keep the first ``fraction`` of the bytes of ``path`` (a write cut short)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * fraction)])


def scramble(path: Path) -> None:
    """Overwrite ``path`` with the same number of bytes of garbage (size checks pass, parsing must not)."""
    size = Path(path).stat().st_size
    Path(path).write_bytes((b"\x00garbage\xff" * (size // 9 + 1))[:size])


def plant_symlink(link: Path, target: Path) -> None:
    """Create ``link`` pointing at ``target`` (another user's trap in a shared folder)."""
    Path(link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


class KillSwitch:
    """Sends SIGKILL to this process just before the ``kill_at``-th call of watched functions.

    Calls are counted only while the switch is armed (inside a call of the function given to
    :meth:`arm_inside`), across every function given to :meth:`watch`. With ``kill_at=None`` nothing is
    killed: the name of each counted call is appended to ``log`` so that a test can list every point.

    Example (in a child process)::

        switch = KillSwitch(kill_at=3, log=None)
        for target in ("torch.save", "os.replace", "os.fsync"):
            switch.watch(target)
        switch.arm_inside("rapidfire_hf.ppo.recipe.checkpoint.save", when=lambda parts: parts.state.global_step == 2)
    """

    def __init__(self, kill_at: int | None, log: Path | None = None):
        self.kill_at, self.log, self.count, self.armed = kill_at, log, 0, False

    def watch(self, target: str) -> None:
        owner, name = _resolve(target)
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.armed:
                self.count += 1
                if self.log is not None:
                    with open(self.log, "a") as f:
                        f.write(target + "\n")
                if self.kill_at is not None and self.count == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def arm_inside(self, target: str, when=lambda *a, **k: True) -> None:
        owner, name = _resolve(target)
        original = getattr(owner, name)

        def armed(*args, **kwargs):
            self.armed = bool(when(*args, **kwargs))
            try:
                return original(*args, **kwargs)
            finally:
                if self.armed and self.kill_at is not None and self.count + 1 == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # just after the last watched call
                self.armed = False

        setattr(owner, name, armed)


def _resolve(target: str):
    """``"pkg.module.Class.attr"`` -> (``pkg.module.Class``, ``"attr"``)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1]
    raise ValueError(f"cannot resolve {target!r}")
