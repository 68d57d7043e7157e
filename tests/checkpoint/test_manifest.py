"""The manifest alone, on a small folder of real files (no training): what it vouches for, and every way a
hostile or damaged folder is refused by name (``rapidfire_hf.checkpoint.manifest``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rapidfire_hf.checkpoint.errors import CheckpointDamagedError, OldCheckpointError
from rapidfire_hf.checkpoint.manifest import MANIFEST, OLD_MARKER, verify, write_manifest
from tests.helpers.faults_io import forge_manifest

IDENTITY = {"tokenizer": {"size": 46, "sha256": "ab" * 32}}
SETTINGS = {"learning_rate": 1e-05, "response_length": 53}


@pytest.fixture()
def folder(tmp_path) -> Path:
    f = tmp_path / "checkpoint-3"
    (f / "policy").mkdir(parents=True)
    torch.save({"state": {0: {"exp_avg": torch.ones(3)}}}, f / "optimizer.pt")
    (f / "policy" / "config.json").write_text('{"hidden_size": 64}')
    (f / "trainer_state.json").write_text('{"global_step": 3}')
    write_manifest(f, 3, 1, IDENTITY, SETTINGS)
    return f


def refused(folder: Path, cls=CheckpointDamagedError) -> str:
    with pytest.raises(cls) as info:
        verify(folder)
    return str(info.value)


def test_it_vouches_for_every_file_identity_and_settings(folder):
    m = verify(folder)
    assert sorted(m.files) == ["optimizer.pt", "policy/config.json", "trainer_state.json"]
    assert (m.global_step, m.num_processes, m.identity, m.settings) == (3, 1, IDENTITY, SETTINGS)
    assert not list(folder.glob(".*"))  # the temporary manifest was renamed into place


@pytest.mark.parametrize("mask", [0x01, 0x20])  # a low bit, and the case bit ('e' <-> 'E' parses the same)
def test_every_flipped_byte_of_the_manifest_is_refused_naming_it(folder, mask):
    path = folder / MANIFEST
    good = path.read_bytes()
    for i in range(len(good)):
        data = bytearray(good)
        data[i] ^= mask
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointDamagedError) as info:
            verify(folder)
        assert info.value.path == path, (i, str(info.value))
    path.write_bytes(good)
    verify(folder)


@pytest.mark.parametrize("name", ["optimizer.pt", "policy/config.json", "trainer_state.json"])
def test_every_flipped_byte_of_a_file_is_refused_naming_it(folder, name):
    path = folder / name
    good = path.read_bytes()
    for i in range(0, len(good), max(1, len(good) // 64)):
        data = bytearray(good)
        data[i] ^= 0x01
        path.write_bytes(bytes(data))
        assert f"{path} does not match its SHA-256" in refused(folder), i
    path.write_bytes(good)


OUTSIDE = ["../secret", "/etc/passwd", "policy/../../secret", "..\\secret", "", "./optimizer.pt", "a//b"]


@pytest.mark.parametrize("rel", OUTSIDE)
def test_a_path_outside_the_folder_is_refused_unread(folder, rel):
    (folder.parent / "secret").write_text("x")
    forge_manifest(folder, lambda info: info["files"].update({rel: {"bytes": 1, "sha256": "0" * 64}}))
    message = refused(folder)
    assert str(folder / MANIFEST) in message and "a path outside the checkpoint folder" in message


def test_truncated_missing_and_extra_files_are_named(folder):
    f = folder / "optimizer.pt"
    good = f.read_bytes()
    f.write_bytes(good[:10])
    assert f"{f} has 10 bytes instead of the {len(good)} that were saved" in refused(folder)
    f.unlink()
    assert f"{f} is missing" in refused(folder)
    f.write_bytes(good)
    extra = folder / "policy" / "model-00002.safetensors"
    extra.write_bytes(b"x")
    assert f"{extra} is not listed in {MANIFEST}" in refused(folder)


def test_symlinks_are_refused(folder, tmp_path):
    f = folder / "optimizer.pt"
    copy = tmp_path / "same_bytes.pt"
    shutil.copy(f, copy)
    f.unlink()
    os.symlink(copy, f)  # the same bytes: only the link itself is wrong
    assert f"{f} is a symbolic link" in refused(folder)
    f.unlink()
    shutil.copy(copy, f)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder / "policy", elsewhere)
    os.symlink(elsewhere, folder / "policy")
    assert f"{folder / 'policy'} is a symbolic link" in refused(folder)


def test_manifest_missing_garbage_nan_or_other_format(folder):
    path = folder / MANIFEST
    good = path.read_bytes()
    path.write_text("{not json")
    assert "cannot be read as a checkpoint manifest" in refused(folder)
    path.write_text("[1, 2]")
    assert "is not a checkpoint manifest" in refused(folder)
    info = json.loads(good)
    info["settings"]["learning_rate"] = float("nan")
    path.write_text(json.dumps(info))  # NaN is not JSON we write
    assert "is not a checkpoint manifest" in refused(folder)
    path.write_bytes(good)
    forge_manifest(folder, lambda i: i.update(format=1))
    assert "has format 1" in refused(folder)
    path.unlink()
    assert f"{path} is missing, so the save of this folder did not finish" in refused(folder)


def test_an_old_sizes_only_checkpoint_is_refused_saying_why(folder):
    (folder / MANIFEST).unlink()
    (folder / OLD_MARKER).write_text('{"format": 1, "files": {}}')
    message = refused(folder, OldCheckpointError)
    assert f"it has {OLD_MARKER} (file sizes only) and no {MANIFEST}" in message


def test_a_folder_copied_elsewhere_verifies_from_any_cwd(folder, tmp_path, monkeypatch):
    moved = tmp_path / "a" / "b" / "c" / folder.name
    shutil.copytree(folder, moved)
    monkeypatch.chdir(tmp_path / "a")
    assert verify(Path(os.path.relpath(moved))).global_step == 3
