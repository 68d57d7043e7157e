"""PPOTrainer under accelerate's FSDP2 on CPU processes (gloo): the rollout engine on the policy gathered once.

Run by tests/distributed/test_ppo_fsdp2.py under ``torchrun --nproc_per_node N`` (N = 1 or 2). accelerate builds
its FSDP plugin only for process groups of accelerators (a gloo group on CPUs is MULTI_CPU and gets DDP), while
torch's ``fully_shard`` runs on CPUs: the script exports the environment ``accelerate launch --config_file
accelerate_configs/fsdp2.yaml`` exports and tells accelerate's shared state that the group is multi-GPU (as
``benchmarks/distributed/ppo_throughput.py --cpu-fsdp2`` does), so the trainer's Accelerator shards the policy
with FSDP2 exactly as on GPUs. Writes ``rank<R>.json``: the greedy rollout of the sharded trainer against the
unsharded policy's ``model.generate`` and static engine, whether every decode step saw gathered weights, the
start table's rollout line, and one PPO update.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[3]


def fsdp2_environment(nproc: int) -> None:
    """The variables ``accelerate launch --config_file accelerate_configs/fsdp2.yaml --mixed_precision no`` sets."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(ROOT / "accelerate_configs/fsdp2.yaml"), "--mixed_precision", "no",
            "--num_processes", str(nproc), "train.py"]  # fmt: skip
    args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            os.environ[key] = value


@contextlib.contextmanager
def counted_all_gathers():
    """The FSDP2 parameter groups that really all-gather inside the block (an unshard of a gathered one is none)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    gathers, original = [], FSDPParamGroup.unshard

    def unshard(group, *args, **kwargs):
        if not group.is_unsharded:
            gathers.append(id(group))
        return original(group, *args, **kwargs)

    FSDPParamGroup.unshard = unshard
    try:
        yield gathers
    finally:
        FSDPParamGroup.unshard = original


def main(out: Path) -> None:
    torch.set_num_threads(1)
    fsdp2_environment(int(os.environ["WORLD_SIZE"]))
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from rollout_check import greedy_rollout_check  # beside this script
    from torch.distributed.tensor import DTensor

    from rapidfire_hf.demo.task import (
        build_char_tokenizer,
        build_tiny_llama,
        make_prompt_dataset,
        vowel_reward,
    )
    from rapidfire_hf.distributed import Engine
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer
    from rapidfire_hf.rollout.sharded import fsdp_units

    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, initializer_range=0.3)
    single = copy.deepcopy(policy).eval()  # the unsharded policy, one process
    config = PPOConfig(
        output_dir=str(out / "run"), use_cpu=True, seed=0, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, num_mini_batches=1, num_ppo_epochs=1, response_length=24,
        stop_token="eos", max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[], disable_tqdm=True,
        save_strategy="no", rollout_backend="static", value_mode="fused", max_grad_norm=0.0,
    )  # fmt: skip
    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # FSDP2 plugin from the env
    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=None,
                         reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(64, seed=0))  # fmt: skip
    assert trainer.engine_support.engine is Engine.FSDP2, trainer.engine_support.engine
    sharded = trainer.accelerator.unwrap_model(trainer.model).policy
    result = {"sharded_before": all(isinstance(p, DTensor) for p in sharded.parameters())}

    # the greedy rollout of the sharded trainer against the unsharded policy (model.generate and the engine)
    facts, gathers = greedy_rollout_check(
        trainer,
        single,
        tok,
        config.response_length,
        lambda: all(not isinstance(p, DTensor) for p in sharded.parameters()),
        counted_all_gathers,
    )
    whole_every_step = facts.pop("whole_steps")
    result.update(facts)
    result.update(
        all_gathers=len(gathers),
        units=len(fsdp_units(trainer.accelerator.unwrap_model(trainer.model))),
        gathered_every_step=whole_every_step,
        sharded_after=all(isinstance(p, DTensor) for p in sharded.parameters()),
    )

    # one PPO update end to end (sampled rollout on the engine, scoring, training step)
    before = [p.detach().to_local().clone() for p in sharded.parameters()]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        trainer.train()
    history = trainer.state.log_history
    result.update(
        updates=trainer.state.global_step,
        policy_loss=next((h["loss/policy_avg"] for h in history if "loss/policy_avg" in h), None),
        moved=any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, sharded.parameters())),
        finite=all(bool(torch.isfinite(p.detach().to_local()).all()) for p in sharded.parameters()),
        rollout_line=next(
            (line.strip(" |") for line in shown.getvalue().splitlines() if "rollout:" in line), None
        ),
    )
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
