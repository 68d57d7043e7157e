"""PPOTrainer under accelerate's DeepSpeed ZeRO-3 plugin on CPU processes (gloo, ``DS_ACCELERATOR=cpu``): the
rollout runs the static engine on the policy gathered once per rollout.

Run by tests/distributed/test_ppo_zero3.py under ``torchrun --nproc_per_node N`` (N = 1 or 2). accelerate takes its
DeepSpeed plugin only when not told ``cpu=True`` and its process group is not a CPU one: the script starts DeepSpeed's
gloo group itself, exports the environment ``accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml
--mixed_precision no`` exports, and tells accelerate's shared state that the group is DeepSpeed's, so the trainer's
Accelerator wraps the policy in a ZeRO-3 engine exactly as on GPUs. Writes ``rank<R>.json``: the greedy rollout of
the partitioned trainer against the unsharded policy's ``model.generate`` and static engine, the gathers one rollout
takes, whether every decode step saw whole weights, the start table's rollout line, and one PPO update.
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


def zero3_environment(nproc: int) -> None:
    """The variables ``accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --mixed_precision no``
    sets."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    argv = ["--config_file", str(ROOT / "accelerate_configs/deepspeed_zero3.yaml"), "--mixed_precision", "no",
            "--num_processes", str(nproc), "train.py"]  # fmt: skip
    args, defaults, from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    # as launch_command sets them before its DeepSpeed launcher
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    for key, value in prepare_deepspeed_cmd_env(args)[1].items():
        if key.startswith("ACCELERATE_"):
            os.environ[key] = value


@contextlib.contextmanager
def counted_gathers():
    """ZeRO-3's gathers inside the block: ``GatheredParameters`` entered on partitioned parameters (whole-model
    gathers) and the per-module fetches of its forward hooks."""
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from rapidfire_hf.rollout.sharded import zero3_partitioned

    counts = {"gathered_parameters": 0, "module_fetches": 0}
    enter, fetch = (
        deepspeed.zero.GatheredParameters.__enter__,
        PartitionedParameterCoordinator.fetch_sub_module,
    )

    def counted_enter(ctx):
        if ctx.enabled and zero3_partitioned(torch.nn.ParameterList(ctx.params)):
            counts["gathered_parameters"] += 1
        return enter(ctx)

    def counted_fetch(coordinator, *args, **kwargs):
        counts["module_fetches"] += 1
        return fetch(coordinator, *args, **kwargs)

    deepspeed.zero.GatheredParameters.__enter__ = counted_enter
    PartitionedParameterCoordinator.fetch_sub_module = counted_fetch
    try:
        yield counts
    finally:
        deepspeed.zero.GatheredParameters.__enter__ = enter
        PartitionedParameterCoordinator.fetch_sub_module = fetch


def main(out: Path) -> None:
    torch.set_num_threads(1)
    zero3_environment(int(os.environ["WORLD_SIZE"]))
    import deepspeed
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from rollout_check import greedy_rollout_check  # beside this script

    from rapidfire_hf.demo.task import (
        build_char_tokenizer,
        build_tiny_llama,
        make_prompt_dataset,
        vowel_reward,
    )
    from rapidfire_hf.distributed import Engine
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer
    from rapidfire_hf.rollout.sharded import zero3_partitioned

    deepspeed.init_distributed(dist_backend="gloo")
    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, initializer_range=0.3)
    single = copy.deepcopy(policy).eval()  # the unsharded policy, one process
    config = PPOConfig(
        output_dir=str(out / "run"), use_cpu=False, seed=0, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, num_mini_batches=1, num_ppo_epochs=1, response_length=24,
        stop_token="eos", max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[], disable_tqdm=True,
        save_strategy="no", rollout_backend="static", value_mode="fused", max_grad_norm=0.0,
    )  # fmt: skip
    # accelerate's state on the gloo group, in place of the one PPOConfig built (not told cpu, it finds no
    # accelerator backend and counts one process); then marked DeepSpeed's, so that the Accelerator takes its plugin
    AcceleratorState._reset_state(reset_partial_state=True)
    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=None,
                         reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(64, seed=0))  # fmt: skip
    assert trainer.engine_support.engine is Engine.ZERO3, trainer.engine_support.engine
    sharded = trainer.accelerator.unwrap_model(trainer.model).policy
    result = {"partitioned_before": zero3_partitioned(sharded)}

    # the greedy rollout of the partitioned trainer against the unsharded policy (model.generate and the engine)
    facts, gathers = greedy_rollout_check(
        trainer, single, tok, config.response_length, lambda: not zero3_partitioned(sharded), counted_gathers
    )
    whole_every_step = facts.pop("whole_steps")
    result.update(facts)
    result.update(
        gathers=gathers,
        whole_every_step=whole_every_step,
        partitioned_after=zero3_partitioned(sharded),
    )

    # one PPO update end to end (sampled rollout on the engine, scoring, training step)
    def whole():
        with deepspeed.zero.GatheredParameters(list(sharded.parameters())):
            return [p.detach().clone() for p in sharded.parameters()]

    before = whole()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        trainer.train()
    after = whole()
    history = trainer.state.log_history
    result.update(
        updates=trainer.state.global_step,
        policy_loss=next((h["loss/policy_avg"] for h in history if "loss/policy_avg" in h), None),
        moved=any(not torch.equal(b, a) for b, a in zip(before, after)),
        finite=all(bool(torch.isfinite(a).all()) for a in after),
        rollout_line=next(
            (line.strip(" |") for line in shown.getvalue().splitlines() if "rollout:" in line), None
        ),
    )
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
