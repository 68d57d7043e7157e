"""Saving and resuming PPOTrainer: models through ``save_pretrained``, optimizer/scheduler/RNG/trainer state beside.

A checkpoint directory ``<output_dir>/checkpoint-<update>/`` holds:
``policy/`` (save_pretrained; the LoRA adapter alone under PEFT), ``value_model/`` or ``value_head.pt``,
the tokenizer, ``optimizer.pt``, ``scheduler.pt``, ``rng_state_<rank>.pt``, ``trainer_state.json`` and,
written last, ``checkpoint_manifest.json`` (:mod:`rapidfire_hf.checkpoint.manifest`: the SHA-256 of every
file, the run's identity and the settings a resume is checked against). Resuming restores all of it, so a
resumed CPU run continues bit-identically.

Writing, the manifest and reading files are shared with ``PPOSweep`` (:mod:`rapidfire_hf.checkpoint`):

- the folder is written atomically (``tmp-`` folder, fsync, manifest last, rename); a failed write raises
  :class:`CheckpointSaveError` naming the file, the earlier checkpoints untouched;
- before anything is restored, every file is checked against the manifest (a flipped bit, a truncated,
  extra, symlinked or missing file is refused by name), read safely (``torch.load(weights_only=True)``:
  no pickled object ever runs), checked for NaN and infinities (named by tensor), and the checkpoint is
  compared with the run (:func:`check_run`): parameter names and shapes, the frozen base/reference/reward
  models, the tokenizer, the LoRA config, the value head, and the settings an update depends on. A
  mismatch raises :class:`CheckpointMismatchError` naming each difference; a changed optimizer setting
  (learning rate, weight decay, betas, epsilon) is said, and the checkpoint's value kept;
- a checkpoint from before manifests is refused (:class:`OldCheckpointError`), saying so.
"""

from __future__ import annotations

import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import torch

from rapidfire_hf.checkpoint.errors import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointMismatchError,
    OldCheckpointError,
)
from rapidfire_hf.checkpoint.identity import (
    adapter_identity,
    compare_identity,
    model_fingerprint,
    tokenizer_identity,
    value_head_identity,
)
from rapidfire_hf.checkpoint.manifest import Manifest, verify
from rapidfire_hf.checkpoint.readers import read_pt, read_safetensors, require_finite
from rapidfire_hf.checkpoint.writer import fsync, latest_checkpoint, write_checkpoint
from rapidfire_hf.ppo.field_facts import compare_settings, update_settings
from rapidfire_hf.ppo.types import PPOTrainerState, TrainedParts

logger = logging.getLogger("rapidfire_hf.ppo.checkpoint")  # the name it had before the recipe folder


def save_models(parts: TrainedParts, output_dir: str | os.PathLike) -> None:
    """Write the policy (and tokenizer) and the value function to ``output_dir``."""
    acc, module = parts.accelerator, parts.module
    out = Path(output_dir)
    if not acc.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    module.policy.save_pretrained(out / "policy")
    parts.tokenizer.save_pretrained(out / "policy")
    if module.fused:
        torch.save(module.value_head.state_dict(), out / "value_head.pt")
    else:
        module.value_model.save_pretrained(out / "value_model")


# ---------------------------------------------------------------------------------------------- saving
def save(parts: TrainedParts) -> Path:
    """Write a full checkpoint for the current ``global_step`` atomically (:func:`write_checkpoint`); returns
    its directory.

    Every rank writes its RNG state; the main process writes the rest, the marker and renames the folder.
    With ``save_total_limit`` set, older complete checkpoints beyond the limit are deleted afterwards.

    Raises:
        CheckpointSaveError: a write failed (disk full, I/O error); it names the checkpoint and the file.
            The unfinished ``tmp-`` folder is removed; the earlier checkpoints are untouched (they are
            only rotated out after the new one is complete and renamed).
    """
    acc, args = parts.accelerator, parts.args

    def write(tmp: Path, writing) -> None:
        with writing(tmp):  # save_pretrained: the file is found in the traceback
            save_models(parts, tmp)
        if acc.is_main_process:
            with writing(tmp / "optimizer.pt"):
                torch.save(parts.optimizer.state_dict(), tmp / "optimizer.pt")
            with writing(tmp / "scheduler.pt"):
                torch.save(parts.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            with writing(tmp / "trainer_state.json"):
                parts.state.save_to_json(str(tmp / "trainer_state.json"))
        rng_file = tmp / f"rng_state_{acc.process_index}.pt"
        with writing(rng_file):
            torch.save(_rng_state(parts.permutation), rng_file)
            fsync(rng_file)

    return write_checkpoint(
        Path(args.output_dir),
        parts.state.global_step,
        write,
        identity=run_identity(parts),
        settings=run_settings(parts),
        save_total_limit=args.save_total_limit,
        num_processes=acc.num_processes,
        main=acc.is_main_process,
        barrier=acc.wait_for_everyone,
    )


def run_settings(parts: TrainedParts) -> dict:
    """The settings a resume is checked against (:func:`check_run`), written into the manifest."""
    args, acc = parts.args, parts.accelerator
    return {
        **update_settings(args),
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "rollout_batch_size": args.local_batch_size * acc.num_processes,
        "num_mini_batches": args.num_mini_batches,
        "seed": args.seed,
        "learning_rate": args.learning_rate,
        "num_train_prompts": parts.num_train_prompts,
    }


def run_identity(parts: TrainedParts) -> dict:
    """The run a checkpoint belongs to (:mod:`rapidfire_hf.checkpoint.identity`), written into the manifest:
    the frozen networks (the LoRA base, the reference, the reward model, a LoRA value model's base), the
    tokenizer, the LoRA configs and the value head."""
    module = parts.module
    value = None if module.fused else module.value_model
    frozen = {
        "base model (the policy's frozen weights)": model_fingerprint(module.policy),
        "reference model": model_fingerprint(parts.ref_model),
        "reward model": model_fingerprint(parts.reward_model),
        "value model's frozen weights": model_fingerprint(value),
    }
    adapters = {}
    for role, m in (("policy", module.policy), ("value_model", value)):
        configs = getattr(m, "peft_config", None)
        if configs:  # {adapter name: config}; the name is left out when there is one
            adapters[role] = adapter_identity(next(iter(configs.values())) if len(configs) == 1 else configs)
    head = (
        value_head_identity("fused", module.value_head.state_dict())
        if module.fused
        else value_head_identity(f"separate {type(value).__name__}", None)
    )
    return {
        "frozen_models": {k: v for k, v in frozen.items() if v is not None},
        "tokenizer": tokenizer_identity(parts.tokenizer),
        "adapters": adapters or None,
        "value_head": head,
    }


def _rng_state(permutation: torch.Generator) -> dict:
    """Every random state the run draws from (the global ones and the epochs' ``permutation`` generator),
    as tensors, ints and floats (loadable with weights_only)."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "permutation": permutation.get_state(),
    }


def _set_rng_state(permutation: torch.Generator, rng: dict) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = rng["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    permutation.set_state(rng["permutation"])


# -------------------------------------------------------------------------------------------- loading
_ADVICE = (
    "The checkpoint is damaged or incomplete: resume from another checkpoint-* folder, or delete this one "
    "(resume_from_checkpoint=True picks the newest complete checkpoint)."
)


def _verified(path: Path, num_processes: int) -> Manifest:
    """The checkpoint's manifest, every file checked against it (:func:`rapidfire_hf.checkpoint.manifest.verify`)."""
    try:
        manifest = verify(path)
    except OldCheckpointError as err:
        raise OldCheckpointError(f"cannot resume from {path}: {err}") from None
    except CheckpointDamagedError as err:
        raise CheckpointError(f"cannot resume from this checkpoint: {err}. {_ADVICE}") from None
    if manifest.num_processes != num_processes:
        raise CheckpointError(
            f"cannot resume from {path}: it was saved by {manifest.num_processes} processes and this run has "
            f"{num_processes}; resume with the same number of processes (each restores its own rng_state_<rank>.pt)"
        )
    return manifest


def _weights(folder: Path, adapter: bool, what: str) -> dict:
    """What ``save_pretrained`` wrote into ``folder`` (the adapter alone under PEFT, else every shard),
    each file checked for non-finite values: NaN weights would be restored and die raw in the first
    rollout."""
    files = [folder / "adapter_model.safetensors"] if adapter else sorted(folder.glob("*.safetensors"))
    state = {}
    for f in files or [folder / "model.safetensors"]:
        part = read_safetensors(f)
        require_finite(f, part, what)
        state.update(part)
    return state


def _load_weights(model: torch.nn.Module, folder: Path, state: dict) -> None:
    """Load safetensors weights written by ``save_pretrained`` (adapter weights under PEFT)."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not _is_tied(model, k)]
    if really_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}"
        )


def _is_tied(model, key: str) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False)) and key.endswith("lm_head.weight")


def _resolve(output_dir, resume_from_checkpoint) -> Path:
    if resume_from_checkpoint is True:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-* folder"
            )
        return path
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={str(path)!r} is not a folder")
    return path


# ------------------------------------------------------------------------------ checking against the run
_NEW_RUN = "start a new run (without resume_from_checkpoint, best in a fresh output_dir)"


def _lr_text(lrs) -> str:
    values = [float(v) for v in lrs]
    return f"{values[0]:g}" if len(set(values)) == 1 else "[" + ", ".join(f"{v:g}" for v in values) + "]"


def _learning_rate_warning(
    parts: TrainedParts, path: Path, settings: dict | None, scheduler_state
) -> str | None:
    """A changed learning rate: the restored optimizer and scheduler state carry the checkpoint's, so
    that one is used. Compared on the scheduler's ``base_lrs`` (what is actually replaced, also with a
    custom optimizer and in checkpoints without ``run_settings.json``), else on ``learning_rate``."""
    saved = scheduler_state.get("base_lrs") if isinstance(scheduler_state, dict) else None
    new = getattr(parts.lr_scheduler, "base_lrs", None)
    if not (isinstance(saved, (list, tuple)) and isinstance(new, (list, tuple)) and len(saved) == len(new)):
        if settings is None or "learning_rate" not in settings:
            return None
        saved, new = [settings["learning_rate"]], [parts.args.learning_rate]
    try:
        if all(math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0) for a, b in zip(saved, new)):
            return None
    except (TypeError, ValueError):
        return None
    return (
        f"rapidfire: resuming from {path}: this run sets learning_rate {_lr_text(new)}, the checkpoint was "
        f"saved with {_lr_text(saved)}. The checkpoint's learning_rate {_lr_text(saved)} is used (the restored "
        f"optimizer and scheduler state carry it); to train with {_lr_text(new)}, {_NEW_RUN}."
    )


def check_run(parts: TrainedParts, manifest: Manifest, scheduler_state=None) -> list[str]:
    """Compare a checkpoint's manifest (identity and settings) with this run, before anything is restored.

    Refused (:class:`CheckpointMismatchError`, naming each setting, both values and the fix), because the
    resumed run would not continue the saved one:

    - the rollout batch (``per_device_train_batch_size * gradient_accumulation_steps`` x processes): the
      prompt order is cut into batches of that size, so prompts of the current epoch would be skipped or
      repeated. Another split of the same product (e.g. 4 x 2 -> 2 x 4, against an out-of-memory) is fine;
    - ``num_mini_batches``: it sets the optimizer steps (and the mini-batch size) of every update;
    - ``seed``: the prompt order is a permutation seeded with ``seed + pass``, so a new seed mid-epoch
      repeats some prompts and skips others. It cannot be "taken" by the resumed run either: the RNG
      states (sampling, dropout) are restored from the checkpoint. So it is refused, not warned about;
    - the number of prompts in ``train_dataset``: the permutation is over all rows and the batches per
      epoch depend on it;
    - each setting of :data:`rapidfire_hf.ppo.field_facts.UPDATE_SETTINGS` (``response_length``,
      ``temperature``, ``kl_coef``, ``cliprange``, ...): each changes what an update computes;
    - the run's identity (:func:`rapidfire_hf.checkpoint.identity.compare_identity`): another base,
      reference or reward model (even of the same shape), another tokenizer (even of the same size),
      another LoRA config (``r``, ``lora_alpha``, targets, ...) or value head.

    Warned about, the checkpoint's value kept (the restored optimizer and scheduler state carry it): a
    changed learning rate, weight decay, Adam betas or epsilon.

    Returns the warnings to log once every check (the model shapes too) has passed.
    """
    args, path, settings = parts.args, manifest.folder, manifest.settings
    now = run_settings(parts)
    problems = []
    old_batch, new_batch = settings.get("rollout_batch_size"), now["rollout_batch_size"]
    if old_batch is not None and old_batch != new_batch:
        old_local = (
            settings.get("per_device_train_batch_size", "?"),
            settings.get("gradient_accumulation_steps", "?"),
        )
        procs = parts.accelerator.num_processes
        per_process = f" x {procs} processes" if procs > 1 else ""
        problems.append(
            f"rollout batch size (per_device_train_batch_size x gradient_accumulation_steps{per_process}): "
            f"saved {old_batch} (per_device_train_batch_size={old_local[0]} x gradient_accumulation_steps="
            f"{old_local[1]}), this run {new_batch} (per_device_train_batch_size="
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps={args.gradient_accumulation_steps}). "
            "The prompt order is cut into rollout batches of this size, so resuming would skip or repeat "
            f"prompts of the current epoch. Resume with per_device_train_batch_size x "
            f"gradient_accumulation_steps = {old_batch // procs} (any split, e.g. per_device_train_batch_size="
            f"{old_local[0]}, gradient_accumulation_steps={old_local[1]}), or {_NEW_RUN}."
        )
    same = [
        (
            "num_mini_batches",
            "it sets the optimizer steps and the mini-batch size of every update, so the resumed run would not "
            "continue the saved one's updates",
        ),
        (
            "seed",
            "the prompt order is a permutation seeded with seed (one per pass over the data), so a new seed "
            "mid-epoch repeats some prompts and skips others (and the sampling RNG is restored from the "
            "checkpoint anyway)",
        ),
        (
            "num_train_prompts",
            "the prompt order is a seeded permutation of all rows of train_dataset and the batches per epoch "
            "depend on their number, so the resumed run would train on another order",
        ),
    ]
    for key, why in same:
        old, new = settings.get(key), now[key]
        if old is None or old == new:
            continue
        if key == "num_train_prompts":
            problems.append(
                f"train_dataset size: saved {old} prompts, this run {new}; {why}. Resume with the "
                f"train_dataset it was saved with ({old} prompts), or {_NEW_RUN}."
            )
        else:
            problems.append(
                f"{key}: saved {old}, this run {new}; {why}. Resume with {key}={old}, or {_NEW_RUN}."
            )
    refused, kept = compare_settings(settings, now)
    problems += [f"{p}, or {_NEW_RUN}." for p in refused]
    different = compare_identity(manifest.identity, run_identity(parts))
    problems += [
        f"{p}. Resume with the models, tokenizer and peft_config it was saved with, or {_NEW_RUN}."
        for p in different
    ]
    if problems:
        what = "another run (model, tokenizer or adapter)" if different else "a run with other settings"
        raise CheckpointMismatchError(
            f"cannot resume from {path}: it was saved by {what}; nothing was restored.\n- "
            + "\n- ".join(problems)
        )
    warnings = [
        f"rapidfire: resuming from {path}: {k}." for k in kept if not k.startswith("learning_rate")
    ]  # the learning rate is compared on the scheduler's base_lrs below
    lr = _learning_rate_warning(parts, path, settings, scheduler_state)
    return warnings + ([lr] if lr else [])


def _model_shapes(model, adapter: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of what ``save_pretrained`` writes for ``model`` (the adapter alone under PEFT)."""
    if adapter:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    return {k: tuple(v.shape) for k, v in state.items()}


def check_shapes(what: str, folder: Path, model, saved: dict, adapter: bool = False) -> None:
    """Refuse a checkpoint whose weights for ``model`` have other names or shapes, before anything loads.

    Raises:
        CheckpointMismatchError: naming the first parameter (in the model's order) whose shape differs,
            with both shapes; or the names only one of the two has.
    """
    expected = _model_shapes(model, adapter)
    for name, shape in expected.items():
        if name in saved and tuple(saved[name].shape) != shape:
            raise CheckpointMismatchError(
                f"cannot resume from {folder.parent}: the {what} does not match the checkpoint's "
                f"({folder.name}): parameter {name} has shape {tuple(saved[name].shape)} in the checkpoint "
                f"and {shape} in this run's model; nothing was restored. Resume with the model the checkpoint "
                f"was saved with (the same config: hidden size, layers, heads, vocabulary), or {_NEW_RUN}."
            )
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if not adapter else set()
    missing = [
        k for k in expected if k not in saved and k not in tied and (adapter or not _is_tied(model, k))
    ]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"cannot resume from {folder.parent}: the {what} does not match the checkpoint's ({folder.name}): "
            f"parameters only in this run's model: {missing[:5]}, only in the checkpoint: {unexpected[:5]}; "
            f"nothing was restored. Resume with the model the checkpoint was saved with, or {_NEW_RUN}."
        )


def load(parts: TrainedParts, resume_from_checkpoint) -> PPOTrainerState:
    """Restore a checkpoint into the trainer's ``parts`` (models, optimizer, scheduler, RNG states); returns
    the checkpoint's trainer state, which the trainer takes as its own (``global_step``: the updates done).

    Every file is checked against the manifest, read, checked for non-finite values, and the checkpoint is
    compared with the run (:func:`check_shapes`, :func:`check_run`) before anything of the trainer changes.

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged (a file changed since it was saved, named),
            holds unsafe objects or non-finite weights or optimizer state (the tensor named), or was saved
            by a different number of processes. Raised before anything is restored.
        OldCheckpointError: written by a rapidfire_hf without manifests; refused.
        CheckpointMismatchError: another model, tokenizer, adapter config or value head, or settings an
            update depends on. Raised before anything is restored.
    """
    acc, module = parts.accelerator, parts.module
    path = _resolve(parts.args.output_dir, resume_from_checkpoint)
    manifest = _verified(path, acc.num_processes)
    policy_adapter = hasattr(module.policy, "peft_config")
    value_adapter = not module.fused and hasattr(module.value_model, "peft_config")
    state_file = path / "trainer_state.json"
    try:
        policy_state = _weights(path / "policy", policy_adapter, "the policy's weights:")
        if module.fused:
            value_state = read_pt(path / "value_head.pt", "value head state dict")
            if not isinstance(value_state, dict):
                raise CheckpointDamagedError(path / "value_head.pt", "does not hold a state dict")
            require_finite(path / "value_head.pt", value_state, "the value weights:")
        else:
            value_state = _weights(path / "value_model", value_adapter, "the value weights:")
        optimizer_state = read_pt(path / "optimizer.pt", "optimizer state dict")
        scheduler_state = read_pt(path / "scheduler.pt", "scheduler state dict")
        rng = read_pt(path / f"rng_state_{acc.process_index}.pt", "RNG state")
        try:
            state = type(parts.state).load_from_json(str(state_file))
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointDamagedError(state_file, "cannot be read as a trainer state", e) from None
        # NaN moments would poison every step after the resume
        require_finite(path / "optimizer.pt", optimizer_state, "the optimizer state:")
    except OldCheckpointError:
        raise
    except CheckpointDamagedError as err:
        raise CheckpointError(f"cannot resume from this checkpoint: {err}. {_ADVICE}") from None

    # Compare before restoring anything: a refused resume leaves the trainer exactly as it was.
    check_shapes("policy", path / "policy", module.policy, policy_state, policy_adapter)
    if module.fused:
        check_shapes("value head", path / "value_head.pt", module.value_head, value_state)
    else:
        check_shapes("value model", path / "value_model", module.value_model, value_state, value_adapter)
    for message in check_run(parts, manifest, scheduler_state):
        logger.warning("%s", message)

    try:  # the optimizer first: it checks its groups before changing anything
        parts.optimizer.load_state_dict(optimizer_state)
        parts.lr_scheduler.load_state_dict(scheduler_state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: its optimizer or scheduler state does not fit this trainer "
            f"({type(e).__name__}: {str(e)[:300]}); resume with the optimizer and settings it was saved with"
        ) from None
    _load_weights(module.policy, path / "policy", policy_state)
    if module.fused:
        module.value_head.load_state_dict(value_state)
    else:
        _load_weights(module.value_model, path / "value_model", value_state)
    try:
        _set_rng_state(parts.permutation, rng)
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError) as e:
        raise CheckpointError(
            f"cannot resume from this checkpoint: {path / f'rng_state_{acc.process_index}.pt'} does not hold an "
            f"RNG state ({type(e).__name__}: {str(e)[:300]}). {_ADVICE}"
        ) from None
    return state
