"""What PPOTrainer reports (:class:`Reporter`): per-update metrics (one host sync per update), logs, sample tables and
the telemetry `rapidfire monitor` reads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rapidfire_hf.optim.step_health import StepHealth
    from rapidfire_hf.ppo.types import Experience, PPOStats


class Reporter:
    """Per-update metrics (one host sync per update), sample tables and telemetry of ``PPOTrainer``.

    Args:
        accelerator: gathers the metrics over the processes.
        processing_class: the tokenizer (decodes sample tables; its EOS is counted).
    """

    def __init__(self, accelerator: Accelerator, processing_class):
        self.accelerator = accelerator
        self.processing_class = processing_class
        self._telemetry_seen: dict[str, int] = {}

    def completion_rows(self, exp: Experience) -> list[dict]:
        """``query``, ``model response`` and ``score`` of each row of a scored rollout."""
        tok = self.processing_class
        prompts = tok.batch_decode(exp.rollout.queries, skip_special_tokens=True)
        completions = tok.batch_decode(exp.postprocessed_responses, skip_special_tokens=True)
        scores = exp.adv.scores.float().tolist()
        return [
            {"query": p, "model response": c, "score": s} for p, c, s in zip(prompts, completions, scores)
        ]

    def report_completions(self, rows: list[dict], step: int, callbacks, shown: int = 5) -> None:
        """Print the first ``shown`` rows as a table, and log all as a ``completions`` table to W&B and
        TensorBoard when ``callbacks`` hold those integrations."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"completions at step {step}", show_lines=True)
        for col in ("query", "model response", "score"):
            table.add_column(col)
        for r in rows[:shown]:
            table.add_row(r["query"], r["model response"], f"{r['score']:.3f}")
        Console().print(table)
        if not rows:
            return
        columns = list(rows[0])
        data = [[r[c] for c in columns] for r in rows]
        for cb in callbacks:
            kind = type(cb).__name__
            wandb = getattr(cb, "_wandb", None)
            if kind == "WandbCallback" and wandb is not None and getattr(wandb, "run", None) is not None:
                wandb.log({"completions": wandb.Table(columns=columns, data=data)})
            writer = getattr(cb, "tb_writer", None)
            if kind == "TensorBoardCallback" and writer is not None:
                head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
                body = "".join(
                    "| " + " | ".join(str(v).replace("|", "\\|") for v in d) + " |\n" for d in data
                )
                writer.add_text("completions", head + body, step)
                writer.flush()

    def metrics(
        self, exp: Experience, stats: PPOStats, times, *, episode: int, train_start: float, scheduler,
        health: StepHealth, oom_splits: int,
    ) -> dict:  # fmt: skip
        """The metrics of one update: device metrics read with one host sync, host metrics, the step
        health's counters read once (a RapidFireOptimizer's rollbacks, skips, clip misses and miss rate,
        pipelined steps), OOM splits and skipped steps."""
        acc = self.accelerator
        device_metrics = update_device_metrics(exp, stats, self.processing_class.eos_token_id)
        stacked = acc.gather_for_metrics(torch.stack(list(device_metrics.values())).unsqueeze(0)).mean(0)
        metrics = dict(zip(device_metrics, stacked.tolist()))  # the one host sync of the update
        metrics["val/num_eos_tokens"] *= acc.num_processes
        metrics.update(update_host_metrics(exp, times, episode, train_start, scheduler, acc.num_processes))
        if health.rapidfire is not None:  # its counters read once
            opt_stats = health.stats()
            for key in ("rollbacks", "skipped", "clip_misses", "pipelined_steps"):
                metrics[f"rapidfire/{key}"] = opt_stats[key]
            # predicted clip coefficients checked, and the share that missed
            metrics["rapidfire/clip_miss_rate"] = opt_stats["clip_misses"] / max(1, opt_stats["clip_checks"])
        metrics["rapidfire/oom_splits"] = oom_splits
        metrics["rapidfire/skipped_steps"] = health.skipped()
        return metrics

    def to_telemetry(self, step: int, metrics: dict) -> None:
        """Feed `rapidfire monitor`: tokens/s every update, and rollback / OOM-split events as they happen."""
        from rapidfire_hf.memory import get_telemetry

        telemetry = get_telemetry()
        telemetry.metrics(
            step,
            {
                "tokens_per_s": metrics["tokens_per_second"],
                "kl": metrics["objective/kl"],
                "reward": metrics["objective/scores"],
            },
        )
        seen = self._telemetry_seen
        for key, event in (("rapidfire/rollbacks", "rollback"), ("rapidfire/oom_splits", "oom_split")):
            new = int(metrics.get(key, 0)) - seen.get(key, 0)
            if new > 0:
                telemetry.event(event, step=step, count=new)
                seen[key] = int(metrics[key])


def update_host_metrics(
    exp: Experience, times, episode: int, train_start: float, scheduler, processes: int = 1
) -> dict:
    """The host-side metrics of one update: the phases' seconds from ``times`` = (start, after rollout,
    after scoring, end), tokens/s over all ``processes``, episodes/s since ``train_start``, the learning
    rate and the episode count. The same keys for PPOTrainer and each PPOSweep trial."""
    t0, t1, t2, t3 = times
    b, width = exp.rollout.query_responses.shape
    return {
        "time/rollout": t1 - t0,
        "time/scoring": t2 - t1,
        "time/training": t3 - t2,
        "time/update": t3 - t0,
        "tokens_per_second": b * width * processes / max(t3 - t0, 1e-9),
        "eps": episode / max(time.perf_counter() - train_start, 1e-9),
        "lr": scheduler.get_last_lr()[0],
        "episode": episode,
    }


def update_device_metrics(exp: Experience, stats: PPOStats, eos_id) -> dict:
    """The per-update metrics of one scored rollout and its PPO statistics, as 0-d device tensors (read
    with one host sync by the caller). Shared by PPOTrainer and PPOSweep's trials."""
    adv = exp.adv
    real = (~adv.padding_mask).float()
    non_score = adv.non_score_reward.sum(1).mean()
    return {
        "objective/kl": adv.kl.sum(1).mean(),
        "objective/entropy": (-adv.logprobs * real).sum(1).mean(),
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": non_score + adv.scores.mean(),
        "objective/scores": adv.scores.mean(),
        "policy/approxkl_avg": stats.approx_kl.mean(),
        "policy/clipfrac_avg": stats.pg_clipfrac.mean(),
        "loss/policy_avg": stats.pg_loss.mean(),
        "loss/value_avg": stats.vf_loss.mean(),
        "val/clipfrac_avg": stats.vf_clipfrac.mean(),
        "policy/entropy_avg": stats.entropy.mean(),
        "val/ratio": stats.ratio.mean(),
        "val/ratio_var": stats.ratio.var() if stats.ratio.numel() > 1 else stats.ratio.sum() * 0,
        "val/num_eos_tokens": (exp.rollout.responses == eos_id).sum().float(),
        "response_length": real.sum(1).mean(),
    }
