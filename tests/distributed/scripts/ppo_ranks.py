"""A couple of PPO updates of ``rapidfire_hf.PPOTrainer`` on the tiny demo task, one process per rank.

Launch with ``torchrun --nproc_per_node 2`` (CPU, gloo) or ``accelerate launch --config_file
accelerate_configs/<engine>.yaml`` (GPUs). Each rank writes ``ppo_rank<r>.pt`` (its parameters as
float64, the logged history, optimizer counters and the engine's feature table); ``test_ppo_ddp.py``
and ``benchmarks/distributed/run.sh`` compare them.

Usage: ``ppo_ranks.py OUT_DIR [--device cuda] [--optimizer rapidfire|adamw] [--bf16]``
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import rapidfire_hf.ppo.recipe.trainer as ppo_trainer
from rapidfire_hf.demo.task import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)
from rapidfire_hf.distributed import attach_sync_debug, describe_engine, gathered_for_generation
from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.ppo import PPOConfig, PPOTrainer

SIZE = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1}


class _MicroBatchAccelerator(ppo_trainer.Accelerator):
    """WORKAROUND (remove when PPOTrainer sets it): DeepSpeed needs ``train_micro_batch_size_per_gpu``
    and PPOTrainer prepares no dataloader for accelerate to read it from."""

    micro_batch = 1

    def prepare(self, *args, **kwargs):
        plugin = self.state.deepspeed_plugin
        if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = self.micro_batch
        return super().prepare(*args, **kwargs)


class GatheringPPOTrainer(PPOTrainer):
    """PPOTrainer whose rollout and scoring see full weights under ZeRO-3/FSDP2, gathered once.

    Scoring calls the backbones' submodules directly (not the prepared root module), so under FSDP2
    the root unit's weights (embeddings, final norm) would still be sharded there.
    """

    def rollout(self, batch):
        with gathered_for_generation(self.accelerator, self.model):
            return super().rollout(batch)

    def score(self, rollout):
        with gathered_for_generation(self.accelerator, self.model):
            return super().score(rollout)


def build_trainer(out: Path, args) -> PPOTrainer:
    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok, **SIZE, seed=0)
    value = build_tiny_value_model(tok, **SIZE, seed=1)
    config = PPOConfig(
        output_dir=str(out / "run"),
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        seed=0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_mini_batches=1,
        num_ppo_epochs=1,
        response_length=8,
        stop_token="eos",
        max_steps=args.updates,
        logging_steps=1,
        learning_rate=1e-3,
        local_rollout_forward_batch_size=4,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        rollout_backend=args.rollout_backend,
        max_grad_norm=0.0,
        rapidfire_config=args.rapidfire_config,
    )
    optimizer = (
        RapidFireOptimizer(lr=1e-3, gradient_pipeline=True, rollback="auto")
        if args.optimizer == "rapidfire"
        else None
    )
    _MicroBatchAccelerator.micro_batch = config.per_device_train_batch_size
    ppo_trainer.Accelerator = _MicroBatchAccelerator
    cls = GatheringPPOTrainer if args.gather else PPOTrainer
    return cls(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_funcs=vowel_reward,
        value_model=value,
        train_dataset=make_prompt_dataset(64, seed=0),
        optimizer=optimizer,
    )


def full_parameters(trainer: PPOTrainer) -> torch.Tensor:
    """All trained parameters as one float64 vector (gathered when the engine shards them)."""
    state = trainer.accelerator.get_state_dict(trainer.model)  # a collective under ZeRO-3 and FSDP
    if not state:  # only the main process receives the gathered dict
        return torch.empty(0, dtype=torch.float64)
    return torch.cat([state[k].detach().reshape(-1).double().cpu() for k in sorted(state)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--optimizer", default="rapidfire", choices=["rapidfire", "adamw"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--rollout-backend", default="auto")
    parser.add_argument("--gather", action="store_true", help="gather sharded weights once per rollout")
    parser.add_argument("--rapidfire-config", default=None, help="a preset name: the throughput planner runs")
    parser.add_argument(
        "--squeeze-rank1", action="store_true", help="rank 1 measures (almost) no free memory"
    )
    args = parser.parse_args()
    if args.squeeze_rank1 and os.environ.get("RANK") == "1":  # its own plan would differ from rank 0's
        import rapidfire_hf.memory.checkpointing as checkpointing

        checkpointing.free_device_bytes = lambda device: 1
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAPIDFIRE_SYNC_DEBUG", "1")
    trainer = build_trainer(args.out, args)
    support = describe_engine(trainer.accelerator)
    sync = attach_sync_debug(trainer, interval=1)
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "params": full_parameters(trainer),
            "history": trainer.state.log_history,
            "sync_reports": [r.__dict__ for r in (sync.checker.reports if sync and sync.checker else [])],
            "optimizer_stats": inner.stats() if hasattr(inner, "stats") else {},
            "engine": support.to_dict(),
            "world_size": trainer.accelerator.num_processes,
            "plan": trainer.plan.to_dict() if trainer.plan is not None else None,
        },
        args.out / f"ppo_rank{rank}.pt",
    )
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
