"""The static engine on a DeepSpeed ZeRO-3 policy (CPU, gloo, ``DS_ACCELERATOR=cpu``): run inside the gather
PPOTrainer's rollout takes (``distributed.generation.gathered_for_generation``: ``GatheredParameters`` once,
ZeRO-3's per-module hooks off meanwhile), refused by name outside it.

Run by tests/distributed/test_rollout_zero3.py under ``torchrun --nproc_per_node N`` (N = 1 or 2). Writes
``rank<R>.json``: the refusal outside the gather, and per rollout (two, a training step between them) whether the
greedy tokens equal the unsharded model's ``model.generate`` and whether every decode step saw whole weights.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")


def main(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from rapidfire_hf.demo.task import build_char_tokenizer, build_tiny_llama
    from rapidfire_hf.distributed import gathered_for_generation
    from rapidfire_hf.rollout import RolloutEngine, SamplingParams
    from rapidfire_hf.rollout.sharded import zero3_partitioned

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, initializer_range=0.3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip
    single = copy.deepcopy(policy).eval()
    ds, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=config)
    model = ds.module
    # what gathered_for_generation reads of the trainer's accelerator under ZeRO-3
    acc = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)),
        num_processes=dist.get_world_size(),
        unwrap_model=lambda m: m.module,
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(3, 40, (3, 9), generator=g)
    params = SamplingParams(max_new_tokens=30, do_sample=False)
    result = {"partitioned": zero3_partitioned(model)}
    try:
        RolloutEngine(model, 0, [], backend="static")
        result["refused"] = None
    except ValueError as err:
        result["refused"] = str(err)
    engine, rollouts = None, []
    for _ in range(2):  # two rollouts, a training step after each
        ref = RolloutEngine(single, 0, [], backend="hf").generate(ids, None, params).responses
        seen = []
        with gathered_for_generation(acc, ds, model):
            if engine is None:  # built once, on gathered weights, as PPOTrainer's rollout builds it
                engine = RolloutEngine(model, 0, [], backend="static")
            engine._static.step_callback = lambda t, seen=seen: seen.append(not zero3_partitioned(model))
            tokens = engine.generate(ids, None, params).responses
        rollouts.append({
            "path": engine.path,
            "tokens": tokens.tolist(),
            "equal": bool(torch.equal(tokens, ref)),
            "steps": len(seen),
            "whole_every_step": bool(seen) and all(seen),
            "partitioned_after": zero3_partitioned(model),
        })  # fmt: skip
        # a training step on both copies: the next rollout must read the new weights
        loss = ds(input_ids=ids, labels=ids).loss
        ds.backward(loss)
        ds.step()
        with torch.no_grad():
            gathered = {n: p for n, p in model.named_parameters()}
            with deepspeed.zero.GatheredParameters(list(gathered.values())):
                for n, p in single.named_parameters():
                    p.copy_(gathered[n])
    result["rollouts"] = rollouts
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
