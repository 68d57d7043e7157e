"""The trained models in the layout TRL 1.12's ``PPOTrainer.save_model`` left, plus the value function.

``<output_dir>/`` holds the policy as ``save_pretrained`` writes it (the LoRA adapter alone under PEFT), so
``AutoModelForCausalLM.from_pretrained(output_dir)`` (or peft's loader) finds it, and the tokenizer,
``training_args.bin`` and a model card ``README.md``. The value function sits beside it: a separate value
model in ``value_model/``; a fused value head as ``v_head.*`` tensors inside the policy's checkpoint (or in
``pytorch_model.bin`` under PEFT), which :class:`rapidfire_hf.AutoModelForCausalLMWithValueHead` reads back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rapidfire_hf.models.value_head import V_HEAD_PREFIX
from rapidfire_hf.ppo.field_facts import CARD_FIELDS
from rapidfire_hf.ppo.types import TrainedParts

CARD = """---
library_name: transformers
tags:
- rapidfire_hf
- ppo
- rlhf
---

# {name}

Trained with PPO by rapidfire_hf's `PPOTrainer` ({value} value function) for {updates} updates
({episodes} episodes), from `{base}`{data}.

| setting | value |
| --- | --- |
{settings}

Load the policy with `AutoModelForCausalLM.from_pretrained("{name}")`{head_hint}.
"""


def save_for_hub(parts: TrainedParts, output_dir: str | os.PathLike, dataset_name: str | None = None) -> None:
    """Write the trained models (``PPOTrainer.trained_parts()``) to ``output_dir`` (main process only) as
    described above; ``dataset_name`` is named in the model card."""
    if not parts.accelerator.is_main_process:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = parts.module
    policy = module.policy
    head = {}
    if module.fused:
        head = {
            V_HEAD_PREFIX + k: v.detach().cpu().contiguous()
            for k, v in module.value_head.state_dict().items()
        }
    if hasattr(policy, "peft_config"):
        policy.save_pretrained(out)
        if head:
            torch.save(head, out / "pytorch_model.bin")
    else:
        policy.save_pretrained(out, state_dict={**policy.state_dict(), **head})
    if not module.fused:
        module.value_model.save_pretrained(out / "value_model")
    parts.tokenizer.save_pretrained(out)
    # training_args.bin as transformers' Trainer writes it; never read back here
    torch.save(parts.args, out / "training_args.bin")
    (out / "README.md").write_text(_model_card(parts, out, dataset_name))


def _model_card(parts: TrainedParts, out: Path, dataset_name: str | None) -> str:
    args, module = parts.args, parts.module
    base = getattr(getattr(module.policy, "config", None), "_name_or_path", "") or "a local model"
    rows = "\n".join(f"| `{k}` | {getattr(args, k, None)} |" for k in CARD_FIELDS)
    hint = (
        "; the policy and its value head together with `rapidfire_hf.AutoModelForCausalLMWithValueHead`"
        if module.fused
        else "; the value model from `value_model/` with `AutoModelForSequenceClassification`"
    )
    return CARD.format(
        name=out.name,
        value="fused value head" if module.fused else "separate value model",
        updates=parts.state.global_step,
        episodes=parts.state.episode,
        base=base,
        data=f" on `{dataset_name}`" if dataset_name else "",
        settings=rows,
        head_hint=hint,
    )


def push_to_hub(
    parts: TrainedParts, commit_message: str = "End of training", dataset_name: str | None = None
) -> str:
    """Save to ``args.output_dir`` and upload that folder to ``args.hub_model_id`` (or the folder's name).

    Returns the URL of the commit. Raises ``RuntimeError`` naming the repository when the upload fails
    (no network, no token).
    """
    args = parts.args
    save_for_hub(parts, args.output_dir, dataset_name)
    if not parts.accelerator.is_main_process:
        return ""
    from huggingface_hub import HfApi

    repo_id = args.hub_model_id or Path(args.output_dir).name
    api = HfApi(token=getattr(args, "hub_token", None))
    try:
        repo = api.create_repo(repo_id, private=getattr(args, "hub_private_repo", None), exist_ok=True)
        info = api.upload_folder(
            repo_id=repo.repo_id, folder_path=args.output_dir, commit_message=commit_message
        )
    except Exception as err:  # noqa: BLE001 - re-raised with what to check
        raise RuntimeError(
            f"push_to_hub to {repo_id!r} failed ({type(err).__name__}: {err}); check the network, "
            "`huggingface-cli login` (or hub_token) and hub_model_id. The models are saved in "
            f"{args.output_dir}."
        ) from err
    return str(getattr(info, "commit_url", info))
