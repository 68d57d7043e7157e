"""The static engine on an FSDP2-sharded policy (CPU, gloo): weights gathered once per rollout.

Run by tests/distributed/test_rollout_fsdp2.py under ``torchrun --nproc_per_node N`` (N = 1 or 2). Writes
``rank<R>.json`` into the output folder: per model and path, whether the greedy tokens equal those of the
unsharded model's ``model.generate``, and whether every decode step saw plain (gathered) weights.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    from rapidfire_hf.rollout import RolloutEngine, SamplingParams
    from rapidfire_hf.rollout.sharded import fsdp_units

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    configs = {
        "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, initializer_range=0.3),
        "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.5),
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 96, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    result = {}
    for model_type, kwargs in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, vocab_size=96, **kwargs)
        ).eval()
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]  # fmt: skip
        blocks = model.model.layers if model_type == "llama" else model.transformer.h
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = fsdp_units(model)
        engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static")
        seen = []
        engine._static.step_callback = lambda t, seen=seen, model=model: seen.append(
            all(not isinstance(p, DTensor) for p in model.parameters())
        )
        tokens = engine.generate(ids, mask, SamplingParams(max_new_tokens=40, do_sample=False)).responses
        result[model_type] = {
            "path": engine.path,
            "units": len(units),
            "equal": bool(torch.equal(tokens, ref)),
            "steps": len(seen),
            "gathered_every_step": all(seen),
            "sharded_after": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
