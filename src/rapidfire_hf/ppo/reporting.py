"""What PPOTrainer reports: per-update metrics (one host sync per update), logs, sample tables and
the telemetry `rapidfire monitor` reads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rapidfire_hf.ppo.types import Experience


class ReportingMixin:
    """Metrics, logging, sample tables and telemetry of ``PPOTrainer``."""

    def show_samples(self, exp: Experience, rows: int = 4) -> None:
        """Print a few prompts, completions and scores of a scored rollout and log them as a table."""
        self._report_completions(self._completion_rows(exp)[:rows])

    def _completion_rows(self, exp: Experience) -> list[dict]:
        tok = self.processing_class
        prompts = tok.batch_decode(exp.rollout.queries, skip_special_tokens=True)
        completions = tok.batch_decode(exp.postprocessed_responses, skip_special_tokens=True)
        scores = exp.adv.scores.float().tolist()
        return [
            {"query": p, "model response": c, "score": s} for p, c, s in zip(prompts, completions, scores)
        ]

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """Complete the eval prompts with the current policy, score them, print the first rows and log them
        as a ``completions`` table to W&B and TensorBoard (when those integrations are active).

        Completions are decoded greedily (TRL 1.12 samples at temperature 0.01 here, nearly the same).

        Args:
            sampling: stop after one eval batch of ``per_device_eval_batch_size`` prompts (TRL's name for
                the call made during training); ``False`` completes the whole eval set.

        Returns:
            One dict per prompt: ``query``, ``model response``, ``score``.
        """
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        size = max(1, int(self.args.per_device_eval_batch_size))
        rows: list[dict] = []
        for start in range(0, len(dataset), size):
            batch = self.data_collator([dataset[i] for i in range(start, min(start + size, len(dataset)))])
            rows += self._completion_rows(self.score(self.rollout(batch, sampling=False)))
            if sampling:
                break
        if self.accelerator.is_main_process:
            self._report_completions(rows)
        return rows

    def evaluate(self, sampling: bool = False) -> dict[str, float]:
        """Mean reward and completion length of :meth:`generate_completions` on the eval prompts, logged
        under ``eval/`` and returned."""
        rows = self.generate_completions(sampling=sampling)
        tok = self.processing_class
        lengths = [len(tok(r["model response"], add_special_tokens=False)["input_ids"]) for r in rows]
        metrics = {
            "eval/objective/scores": sum(r["score"] for r in rows) / max(len(rows), 1),
            "eval/response_length": sum(lengths) / max(len(lengths), 1),
        }
        self.log(metrics)
        return metrics

    def _report_completions(self, rows: list[dict], shown: int = 5) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"completions at step {self.state.global_step}", show_lines=True)
        for col in ("query", "model response", "score"):
            table.add_column(col)
        for r in rows[:shown]:
            table.add_row(r["query"], r["model response"], f"{r['score']:.3f}")
        Console().print(table)
        if not rows:
            return
        columns = list(rows[0])
        data = [[r[c] for c in columns] for r in rows]
        for cb in self.callback_handler.callbacks:
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
                writer.add_text("completions", head + body, self.state.global_step)
                writer.flush()

    def _metrics(self, exp: Experience, stats: dict, times) -> dict:
        acc = self.accelerator
        device_metrics = update_device_metrics(exp, stats, self.processing_class.eos_token_id)
        stacked = acc.gather_for_metrics(torch.stack(list(device_metrics.values())).unsqueeze(0)).mean(0)
        metrics = dict(zip(device_metrics, stacked.tolist()))  # the one host sync of the update
        metrics["val/num_eos_tokens"] *= acc.num_processes
        metrics.update(
            update_host_metrics(
                exp, times, self.state.episode, self._train_start, self.lr_scheduler, acc.num_processes
            )
        )
        if self._rf_opt is not None:
            opt_stats = self._rf_opt.stats()
            for key in ("rollbacks", "skipped", "clip_misses", "pipelined_steps"):
                metrics[f"rapidfire/{key}"] = opt_stats[key]
        metrics["rapidfire/oom_splits"] = self._oom_splits
        return metrics

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` and send them to the callbacks; the ``rapidfire/*`` keys only every
        ``logging.log_every`` updates of the rapidfire config (every log without one)."""
        logs = dict(logs)
        cadence = getattr(self, "_log_cadence", None)
        if cadence is None:
            from rapidfire_hf.utils.logs import LogCadence

            cadence = self._log_cadence = LogCadence.from_config(getattr(self, "rf_config", None))
        if not cadence.due(self.state.global_step):
            logs = {k: v for k, v in logs.items() if not k.startswith("rapidfire/")}
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _to_telemetry(self, step: int, metrics: dict) -> None:
        """Feed `rapidfire monitor`: tokens/s every update, and rollback / OOM-split events as they happen."""
        if self.memory_callback is None:
            return
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


def update_device_metrics(exp: Experience, stats: dict, eos_id) -> dict:
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
        "policy/approxkl_avg": stats["approx_kl"].mean(),
        "policy/clipfrac_avg": stats["pg_clipfrac"].mean(),
        "loss/policy_avg": stats["pg_loss"].mean(),
        "loss/value_avg": stats["vf_loss"].mean(),
        "val/clipfrac_avg": stats["vf_clipfrac"].mean(),
        "policy/entropy_avg": stats["entropy"].mean(),
        "val/ratio": stats["ratio"].mean(),
        "val/ratio_var": stats["ratio"].var() if stats["ratio"].numel() > 1 else stats["ratio"].sum() * 0,
        "val/num_eos_tokens": (exp.rollout.responses == eos_id).sum().float(),
        "response_length": real.sum(1).mean(),
    }
