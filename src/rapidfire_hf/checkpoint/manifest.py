"""The manifest of a checkpoint: what was saved, byte for byte, and by which run.

``checkpoint_manifest.json`` is written last into a checkpoint folder, atomically (a temporary file,
fsync, ``os.replace``), and holds:

- ``files``: every file of the folder (relative POSIX paths) with its size and SHA-256;
- ``identity``: the run the checkpoint belongs to (:mod:`rapidfire_hf.checkpoint.identity`: base model
  fingerprint, tokenizer hash, adapter config, value-head config, reward model fingerprint);
- ``settings``: the settings a resume is compared with;
- ``global_step``, ``num_processes``, ``format`` and ``manifest_sha256``, the SHA-256 of the rest.

It is written in one canonical form (sorted keys, no spaces), so any change of its bytes is caught: a
change that still parses alters either the checksum or the canonical form.

:func:`verify` reads it back and checks the folder against it before a single tensor is loaded: no path
outside the folder, no symbolic link, no file the manifest does not list, every listed file present with
its size and hash. A folder from before manifests (only ``checkpoint_complete.json``, sizes only) is
refused: neither its bytes nor its run can be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rapidfire_hf.checkpoint.errors import CheckpointDamagedError, OldCheckpointError

MANIFEST = "checkpoint_manifest.json"
OLD_MARKER = "checkpoint_complete.json"  # rapidfire_hf before manifests: file sizes only
FORMAT = 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Manifest:
    """A verified manifest: the folder's files are exactly these, with these hashes."""

    folder: Path
    global_step: int
    num_processes: int
    files: dict[str, dict]
    identity: dict
    settings: dict


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks (a 30 GB optimizer state never sits in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _canonical(data: dict) -> bytes:
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def write_manifest(
    folder: Path, global_step: int, num_processes: int, identity: dict, settings: dict
) -> Path:
    """Hash every file of ``folder`` and write the manifest last, atomically; returns its path.

    ``identity`` and ``settings`` must be JSON values (no NaN). Symbolic links are never written by a save,
    so one found here is an error (``ValueError``).
    """
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            raise ValueError(f"{path} is a symbolic link: a checkpoint holds plain files only")
        if path.is_file() and rel != MANIFEST and not rel.startswith(f".{MANIFEST}"):
            files[rel] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    body = {
        "format": FORMAT,
        "global_step": int(global_step),
        "num_processes": int(num_processes),
        "files": files,
        "identity": identity,
        "settings": settings,
    }
    data = _canonical({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()})
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    if os.name == "posix":  # the rename itself on disk
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return folder / MANIFEST


def has_manifest(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest (a save that finished), without reading it."""
    return (folder / MANIFEST).is_file()


def is_complete(folder: Path) -> bool:
    """Whether a save of ``folder`` finished: a manifest, or the older sizes-only marker (which
    :func:`verify` refuses, with a message saying why, rather than skipping the folder silently)."""
    return has_manifest(folder) or (folder / OLD_MARKER).is_file()


def _read(folder: Path) -> dict:
    path = folder / MANIFEST
    if path.is_symlink():
        raise CheckpointDamagedError(path, "is a symbolic link; a checkpoint holds plain files only")
    if not path.is_file():
        if (folder / OLD_MARKER).is_file():
            raise OldCheckpointError(
                f"{folder} was written by an older rapidfire_hf: it has {OLD_MARKER} (file sizes only) and no "
                f"{MANIFEST} (content hashes, the run's identity and settings), so neither its bytes nor the run "
                "it continues can be verified; it is refused. Resume it with the rapidfire_hf release that wrote "
                "it, or start a new run."
            )
        raise CheckpointDamagedError(path, "is missing, so the save of this folder did not finish")
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as err:
        raise CheckpointDamagedError(path, "cannot be read as a checkpoint manifest", err) from None
    if not isinstance(data, dict) or not isinstance(data.get("manifest_sha256"), str):
        raise CheckpointDamagedError(path, "is not a checkpoint manifest (no manifest_sha256)")
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    try:
        same_form = _canonical(data) == raw
        same_sum = hashlib.sha256(_canonical(body)).hexdigest() == data["manifest_sha256"]
    except ValueError as err:  # a NaN smuggled in
        raise CheckpointDamagedError(path, "is not a checkpoint manifest", err) from None
    if not (same_form and same_sum):
        raise CheckpointDamagedError(
            path,
            "does not match its own checksum: it was changed after it was saved (a flipped bit, an edit)",
        )
    if body.get("format") != FORMAT:
        raise CheckpointDamagedError(
            path, f"has format {body.get('format')!r}; this release reads format {FORMAT}"
        )
    ok = (
        isinstance(body.get("files"), dict)
        and all(isinstance(v, dict) for v in body["files"].values())
        and isinstance(body.get("identity"), dict)
        and isinstance(body.get("settings"), dict)
        and isinstance(body.get("global_step"), int)
        and isinstance(body.get("num_processes"), int)
    )
    if not ok:
        raise CheckpointDamagedError(
            path, "is not a checkpoint manifest (files, identity, settings, global_step)"
        )
    return body


def _safe_relative(folder: Path, rel: str) -> Path:
    """``folder / rel`` for a plain relative POSIX path inside the folder, written as the writer writes it
    (no ``.``, ``..`` or empty part, no backslash); refuses anything else."""
    parts = rel.split("/")  # JSON object keys are always strings
    bad = (
        "\\" in rel
        or "\0" in rel
        or any(p in ("", ".", "..") for p in parts)
        or PurePosixPath(rel).is_absolute()
        or len(rel) > 4096
    )
    if bad:
        raise CheckpointDamagedError(
            folder / MANIFEST,
            f"lists {str(rel)[:80]!r}, a path outside the checkpoint folder; refused unread",
        )
    return folder.joinpath(*parts)


def verify(folder: Path) -> Manifest:
    """Check every file of ``folder`` against its manifest; returns the manifest.

    Raises:
        OldCheckpointError: the folder has only the older sizes-only marker.
        CheckpointDamagedError: naming the file: the manifest missing, changed or malformed; a listed path
            outside the folder; a symbolic link; a file the manifest does not list; a listed file missing,
            of another size or another SHA-256.
    """
    folder = Path(folder)
    body = _read(folder)
    listed = {}
    for rel, entry in body["files"].items():
        path = _safe_relative(folder, rel)
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not (isinstance(size, int) and isinstance(digest, str) and _HEX64.match(digest)):
            raise CheckpointDamagedError(folder / MANIFEST, f"has no valid size and sha256 for {rel!r}")
        listed[path] = (size, digest)
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows links
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointDamagedError(
                    path, "is a symbolic link; a checkpoint holds plain files only (copy the file in instead)"
                )
            if stat.S_ISREG(mode) and path not in listed and path != folder / MANIFEST:
                raise CheckpointDamagedError(
                    path, f"is not listed in {MANIFEST}: this save did not write it (remove it)"
                )
    for path, (size, digest) in listed.items():
        if not path.is_file():
            raise CheckpointDamagedError(path, "is missing")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointDamagedError(path, f"has {actual} bytes instead of the {size} that were saved")
        if file_sha256(path) != digest:
            raise CheckpointDamagedError(
                path,
                "does not match its SHA-256 in the manifest: it changed after it was saved (a flipped bit)",
            )
    return Manifest(
        folder, body["global_step"], body["num_processes"], body["files"], body["identity"], body["settings"]
    )
