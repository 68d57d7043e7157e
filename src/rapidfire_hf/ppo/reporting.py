"""What PPOTrainer reports: per-update metrics (one host sync per update), logs and sample tables."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rapidfire_hf.ppo.trainer import Experience


class ReportingMixin:
    """Metrics, logging and sample tables of ``PPOTrainer``."""

    def show_samples(self, exp: Experience, rows: int = 4) -> None:
        """Print a few prompts, completions and scores of a scored rollout (``num_sample_generations``)."""
        from rich.console import Console
        from rich.table import Table

        tok = self.processing_class
        table = Table(title=f"samples at update {self.state.global_step + 1}", show_lines=True)
        for col in ("prompt", "completion", "score"):
            table.add_column(col)
        n = min(rows, exp.rollout.queries.shape[0])
        prompts = tok.batch_decode(exp.rollout.queries[:n], skip_special_tokens=True)
        completions = tok.batch_decode(exp.postprocessed_responses[:n], skip_special_tokens=True)
        for p, c, sc in zip(prompts, completions, exp.adv.scores[:n].tolist()):
            table.add_row(p, c, f"{sc:.3f}")
        Console().print(table)

    def _metrics(self, exp: Experience, stats: dict, times) -> dict:
        acc, adv = self.accelerator, exp.adv
        real = (~adv.padding_mask).float()
        mean_kl = adv.kl.sum(1).mean()
        non_score = adv.non_score_reward.sum(1).mean()
        device_metrics = {
            "objective/kl": mean_kl,
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
            "val/ratio_var": stats["ratio"].var()
            if stats["ratio"].numel() > 1
            else torch.zeros((), device=acc.device),
            "val/num_eos_tokens": (exp.rollout.responses == self.processing_class.eos_token_id).sum().float(),
            "response_length": real.sum(1).mean() + 0,
        }
        stacked = acc.gather_for_metrics(torch.stack(list(device_metrics.values())).unsqueeze(0)).mean(0)
        metrics = dict(zip(device_metrics, stacked.tolist()))  # the one host sync of the update
        metrics["val/num_eos_tokens"] *= acc.num_processes
        t0, t1, t2, t3 = times
        b, width = exp.rollout.query_responses.shape
        metrics.update(
            {
                "time/rollout": t1 - t0,
                "time/scoring": t2 - t1,
                "time/training": t3 - t2,
                "time/update": t3 - t0,
                "tokens_per_second": b * width * acc.num_processes / max(t3 - t0, 1e-9),
                "eps": self.state.episode / max(time.perf_counter() - self._train_start, 1e-9),
                "lr": self.lr_scheduler.get_last_lr()[0],
                "episode": self.state.episode,
            }
        )
        if self._rf_opt is not None:
            opt_stats = self._rf_opt.stats()
            for key in ("rollbacks", "skipped", "clip_misses", "pipelined_steps"):
                metrics[f"rapidfire/{key}"] = opt_stats[key]
        metrics["rapidfire/oom_splits"] = self._oom_splits
        return metrics

    def log(self, logs: dict[str, float]) -> None:
        logs = dict(logs)
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
