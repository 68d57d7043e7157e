"""The PPO optimisation pass of PPOTrainer (a mixin): ``num_ppo_epochs`` x mini-batches x
micro-batches of the clipped PPO loss over a scored rollout, the optimizer step of each window with its
health checks (a RapidFireOptimizer's own, else a :class:`NonFiniteGuard`), the replay of windows a
rollback undid, and the precision plugin's sensitivity pass on the first scored rollout."""

from __future__ import annotations

import logging

import torch
from accelerate.utils import DistributedType

from rapidfire_hf.ppo.core import ppo_loss
from rapidfire_hf.ppo.planning import plan_run
from rapidfire_hf.ppo.types import STAT_KEYS, Experience

logger = logging.getLogger("rapidfire_hf.ppo.trainer")  # PPOTrainer's logger: one name for its messages


def micro_batch_parts(whole: int, micro: int, offset: int, length: int) -> list[tuple[int, int, int, int]]:
    """The user's micro-batches (``micro`` rows each, the last maybe fewer) that rows
    ``[offset, offset + length)`` of a training forward of ``whole`` rows touch: ``(lo, hi, g_lo, g_hi)``
    with ``lo:hi`` the rows in the piece and ``g_lo:g_hi`` the micro-batch's rows in the whole forward."""
    parts = []
    for g_lo in range(0, whole, micro):
        g_hi = min(g_lo + micro, whole)
        lo, hi = max(g_lo, offset), min(g_hi, offset + length)
        if lo < hi:
            parts.append((lo - offset, hi - offset, g_lo, g_hi))
    return parts


def _add(a, b):
    return type(a)(**{f: getattr(a, f) + getattr(b, f) for f in vars(a)})


class OptimizationMixin:
    """The PPO epochs and optimizer steps of ``PPOTrainer``."""

    def optimize(
        self, exp: Experience, permutations: list[torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``num_ppo_epochs`` passes of mini-batch PPO over a scored rollout. Returns device-side statistics.

        Args:
            exp: the scored rollout.
            permutations: one row order per epoch (default: drawn from the trainer's seeded generator).
        """
        args, acc = self.args, self.accelerator
        n, mb = args.local_batch_size, args.local_mini_batch_size
        if self.plan is None:  # optimize() called outside train(): plan (and apply) now
            plan_run(self, exp.rollout.queries)
        steps = -(-mb // self.plan.train_rows)  # forwards per optimizer step (merged micro-batches)
        shape = (args.num_ppo_epochs, args.num_mini_batches, steps)
        stats = {k: torch.zeros(shape, device=acc.device) for k in STAT_KEYS}
        self.model.train()
        if self._oom_recovery is not None:  # memory may differ after the rollout: try whole micro-batches
            self._oom_recovery.reset()
        for epoch in range(args.num_ppo_epochs):
            perm = (
                permutations[epoch]
                if permutations is not None
                else torch.randperm(n, generator=self._perm_generator)
            )
            for m, mb_start in enumerate(range(0, n, mb)):
                self._train_windows(exp, stats, [(epoch, m, perm[mb_start : mb_start + mb])])
        if self._rf_opt is not None and hasattr(self._rf_opt, "verify_now"):
            # the rollout of the next update uses these weights: verify what is still unverified now
            self._train_windows(exp, stats, self._replays(self._rf_opt.verify_now()))
        self._window_rows = {}
        return stats

    def _train_windows(self, exp, stats, windows) -> None:
        """Run optimizer windows ``(epoch, mini-batch, rows)`` in order, and the windows the optimizer
        asks to replay after a rollback (``last_rollback.replay``) before anything new."""
        qr, ctx, adv = exp.rollout.query_responses, exp.rollout.queries.shape[1], exp.adv
        mb, micro = self.args.local_mini_batch_size, self.plan.train_rows
        window_rows = self.__dict__.setdefault("_window_rows", {})  # optimizer step -> its window
        queue = list(windows)
        budget = 4 * max(1, self.args.num_ppo_epochs * self.args.num_mini_batches)  # replays per call
        while queue:
            epoch, m, mb_idx = queue.pop(0)
            if self._rf_opt is not None:
                window_rows[self._rf_opt.stats()["steps"]] = (epoch, m, mb_idx)
            for u, start in enumerate(range(0, mb, micro)):
                idx = mb_idx[start : start + micro].to(qr.device)
                out, ent = self._micro_step(qr[idx], ctx, adv, idx)
                values = (out.approx_kl, out.pg_clipfrac, out.pg_loss, out.vf_loss, out.vf_clipfrac, ent)
                for key, value in zip(STAT_KEYS, (*values, out.ratio_mean)):
                    stats[key][epoch, m, u] = value
            replays = self._replays(getattr(self._rf_opt, "last_rollback", None))
            if replays and budget > 0:
                budget -= len(replays)
                queue[:0] = replays

    def _replays(self, report) -> list:
        """The windows ``(epoch, mini-batch, rows)`` a rollback report asks to run again, in order."""
        if report is None:
            return []
        rows = self.__dict__.get("_window_rows", {})
        return [rows[s] for s in report.replay if s in rows]

    def _micro_step(self, query_responses, ctx, adv, idx):
        """Forward, loss and backward of one micro-batch; the optimizer steps when its window closes.

        A CUDA out-of-memory error splits the micro-batch in halves (recursively, up to
        ``max_oom_splits`` times) with every piece normalised by the whole micro-batch's token counts,
        so the accumulated gradient is the one the whole batch gives and no sample is dropped.
        """
        with self.accelerator.accumulate(self.model):
            out, entropy = self._forward_backward_recovering(query_responses, ctx, adv, idx)
            if self._rf_opt is not None:  # device tensors only: verified at the end of the window
                self._rf_opt.observe_loss(out.loss)
                self._rf_opt.record("approx_kl", out.approx_kl, reduce="max")
            elif self._step_guard is not None:
                self._step_guard.observe_loss(out.loss)
            self._optimizer_step()
        return out, entropy.mean()

    def _forward_backward(self, query_responses, ctx, adv, idx, whole=None, offset=0):
        """Forward, loss and backward of rows ``idx``: the whole training forward (``whole`` None), or
        the piece of ``whole`` starting at row ``offset`` (OOM recovery). The loss is the mean of the
        losses of the user's micro-batches in ``whole`` (one, or ``plan.merge`` of them), each normalised
        by that micro-batch's own token counts, so pieces and merged forwards give the gradient the user's
        split gives (``micro_batch_parts``)."""
        args = self.args
        lp, vpred, entropy = self.model(
            query_responses, self.pad_token_id, ctx, args.temperature, with_entropy=True
        )
        whole = idx if whole is None else whole
        parts = micro_batch_parts(len(whole), args.per_device_train_batch_size, offset, len(idx))
        out = None
        for lo, hi, g_lo, g_hi in parts:
            rows, group = idx[lo:hi], whole[g_lo:g_hi]
            counts = None
            if (hi - lo) != (g_hi - g_lo):  # a piece of this micro-batch: its whole counts
                pad, p1 = adv.padding_mask[group], adv.padding_mask_p1[group]
                counts = ((~pad).sum().clamp_min(1), (~p1).sum().clamp_min(1), pad.numel())
            part = ppo_loss(
                lp[lo:hi],
                adv.logprobs[rows],
                adv.advantages[rows],
                vpred[lo:hi],
                adv.values[rows],
                adv.returns[rows],
                adv.padding_mask[rows],
                adv.padding_mask_p1[rows],
                cliprange=args.cliprange,
                cliprange_value=args.cliprange_value,
                vf_coef=args.vf_coef,
                counts=counts,
            )
            out = part if out is None else _add(out, part)
        groups = -(-len(whole) // args.per_device_train_batch_size)
        if groups > 1:  # the mean over the merged micro-batches
            out = type(out)(**{f: v / groups for f, v in vars(out).items()})
        self.accelerator.backward(out.loss)
        out.loss = out.loss.detach()
        return out, entropy.detach()

    def _make_step_guard(self):
        """A :class:`NonFiniteGuard` for an optimizer that does not verify its own steps (None for a
        RapidFireOptimizer, under DeepSpeed, whose engine owns the step, and under fp16 loss scaling,
        whose GradScaler already skips non-finite steps)."""
        from rapidfire_hf.optim.guard import NonFiniteGuard

        acc = self.accelerator
        if self._rf_opt is not None or acc.distributed_type == DistributedType.DEEPSPEED:
            return None
        if getattr(acc, "scaler", None) is not None:
            return None
        return NonFiniteGuard(self.args.max_consecutive_skips, owner="PPOTrainer")

    def _skipped_steps(self) -> int:
        """Optimizer steps skipped so far as unhealthy; reads the guard's flags of this update (one host
        read) and raises ConsecutiveSkipsError after ``max_consecutive_skips`` in a row."""
        if self._rf_opt is not None:
            stats = self._rf_opt.stats()
            return stats["skipped"] - stats["clip_misses"]
        if self._step_guard is not None:
            self._step_guard.drain()
            return self._step_guard.skipped
        return 0

    def _optimizer_step(self):
        acc, args = self.accelerator, self.args
        if acc.sync_gradients:
            self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0 and not self._optimizer_clips:
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
            if self.precision_plugin is not None:
                self.precision_plugin.observe_gradients()
        if acc.sync_gradients and self._step_guard is not None and self._rf_opt is None:
            # a NaN/inf loss or gradient never reaches the weights (skipped on the device when it can be)
            self._step_guard.step(self.optimizer, self._trainable, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if acc.sync_gradients:
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)

    def _calibrate_precision(self, exp: Experience) -> None:
        """The precision plugin's sensitivity pass on the first scored rollouts (its per-layer schedule).

        The pass compares each layer in the low precision with an fp32 reference, so it needs fp32
        weights (mixed precision); with weights stored in bf16/fp16 there is nothing to compare with and
        the schedule stays as configured (said once in the log). It differentiates with
        ``torch.autograd.grad`` only: no ``.grad`` is written, so no optimizer hook fires.
        """
        plugin, args = self.precision_plugin, self.args
        if plugin.calibration_skipped is not None:
            return
        if any(p.dtype != torch.float32 for p in plugin.model.parameters()):
            plugin.calibration_skipped = (
                "the model's weights are not fp32"  # the plugin's own flag: one place
            )
            logger.info("rapidfire: no precision sensitivity pass (%s)", plugin.calibration_skipped)
            return
        ctx = exp.rollout.queries.shape[1]

        def loss_fn(model, batch):  # what training differentiates: log-probs and values of the rollout
            logprobs, values, _ = model(batch["query_responses"], self.pad_token_id, ctx, args.temperature)
            return -logprobs.mean() + args.vf_coef * values.pow(2).mean()

        rows = exp.rollout.query_responses[: args.per_device_train_batch_size]
        plugin.calibrate({"query_responses": rows}, loss_fn=loss_fn)  # logs the schedule when complete
