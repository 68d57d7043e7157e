"""Saving and resuming PPO: models through ``save_pretrained``, optimizer/scheduler/RNG/trainer state beside.

A checkpoint directory ``<output_dir>/checkpoint-<update>/`` holds:
``policy/`` (save_pretrained; the LoRA adapter alone under PEFT), ``value_model/`` or ``value_head.pt``,
the tokenizer, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt`` and ``trainer_state.json``. Resuming
restores all of it, so a resumed CPU run continues bit-identically.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

_CKPT = re.compile(r"^checkpoint-(\d+)$")


def save_models(trainer, output_dir: str | os.PathLike) -> None:
    """Write the policy (and tokenizer) and the value function to ``output_dir``."""
    acc = trainer.accelerator
    module = acc.unwrap_model(trainer.model)
    out = Path(output_dir)
    if not acc.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    module.policy.save_pretrained(out / "policy")
    trainer.processing_class.save_pretrained(out / "policy")
    if module.fused:
        torch.save(module.value_head.state_dict(), out / "value_head.pt")
    else:
        module.value_model.save_pretrained(out / "value_model")


def save(trainer) -> Path:
    """Write a full checkpoint for the current ``global_step``; returns its directory."""
    acc = trainer.accelerator
    path = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    acc.wait_for_everyone()
    save_models(trainer, path)
    if acc.is_main_process:
        torch.save(trainer.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(trainer.lr_scheduler.state_dict(), path / "scheduler.pt")
        trainer.state.save_to_json(str(path / "trainer_state.json"))
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "permutation": trainer._perm_generator.get_state(),
    }
    torch.save(rng, path / f"rng_state_{acc.process_index}.pt")
    acc.wait_for_everyone()
    return path


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = [
        (int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*") if (m := _CKPT.match(p.name))
    ]
    return max(found)[1] if found else None


def _load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load safetensors weights written by ``save_pretrained`` (adapter weights under PEFT)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
        return
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}: the checkpoint is incomplete")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not _is_tied(model, k)]
    if really_missing or unexpected:
        raise RuntimeError(
            f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}"
        )


def _is_tied(model, key: str) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False)) and key.endswith("lm_head.weight")


def load(trainer, resume_from_checkpoint) -> int:
    """Restore a checkpoint into ``trainer``; returns the number of updates already done."""
    args, acc = trainer.args, trainer.accelerator
    if resume_from_checkpoint is True:
        path = latest_checkpoint(args.output_dir)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {args.output_dir} holds no checkpoint-* folder"
            )
    else:
        path = Path(resume_from_checkpoint)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a PPOTrainer checkpoint (no trainer_state.json)")
    module = acc.unwrap_model(trainer.model)
    _load_weights(module.policy, path / "policy")
    if module.fused:
        module.value_head.load_state_dict(torch.load(path / "value_head.pt", map_location="cpu"))
    else:
        _load_weights(module.value_model, path / "value_model")
    trainer.optimizer.load_state_dict(
        torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    )
    trainer.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    state = type(trainer.state).load_from_json(str(path / "trainer_state.json"))
    trainer.state = state
    rng_file = path / f"rng_state_{acc.process_index}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        trainer._perm_generator.set_state(rng["permutation"])
    return state.global_step
