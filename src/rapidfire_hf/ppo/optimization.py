"""The PPO epochs of PPOTrainer: ``num_ppo_epochs`` x mini-batches x micro-batches of the clipped PPO loss
over a scored rollout (forward, loss, backward here; each micro-batch stepped by the
:class:`~rapidfire_hf.ppo.stepper.Stepper`), the replay of windows a rollback undid, and the precision
plugin's sensitivity pass on the first scored rollout."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from rapidfire_hf.ppo.core import ppo_loss
from rapidfire_hf.ppo.stepper import Stepper
from rapidfire_hf.ppo.types import Experience, PPOStats

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.ppo.modeling import PolicyAndValue

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


def mini_batches(args, generator: torch.Generator, permutations: list[torch.Tensor] | None = None):
    """The optimizer windows of one update in order: ``(epoch, mini-batch, row indices)``.

    Each epoch's row order is drawn from ``generator`` when the epoch starts (``permutations`` given: those);
    a window is one mini-batch of ``args.local_mini_batch_size`` rows. The order PPOTrainer and every trial
    of a sweep train in.
    """
    n, mb = args.local_batch_size, args.local_mini_batch_size
    for epoch in range(args.num_ppo_epochs):
        perm = permutations[epoch] if permutations is not None else torch.randperm(n, generator=generator)
        for m, start in enumerate(range(0, n, mb)):
            yield epoch, m, perm[start : start + mb]


def micro_batch_starts(args, rows_per_forward: int) -> range:
    """Where each forward of a window starts in its mini-batch (``rows_per_forward`` rows each)."""
    return range(0, args.local_mini_batch_size, rows_per_forward)


def new_stats(args, rows_per_forward: int, device) -> PPOStats:
    """Zeroed statistics of one update: one value per training forward of ``rows_per_forward`` rows."""
    shape = (args.num_ppo_epochs, args.num_mini_batches, len(micro_batch_starts(args, rows_per_forward)))
    return PPOStats.zeros(shape, device)


def rows_loss(args, adv, rows: torch.Tensor, logprobs: torch.Tensor, values: torch.Tensor, counts=None):
    """:func:`~rapidfire_hf.ppo.core.ppo_loss` of rows ``rows`` of a scored rollout's advantages ``adv``, given
    their new ``logprobs`` and ``values`` ``[len(rows), R]``, with ``args``' clip ranges and ``vf_coef``."""
    return ppo_loss(
        logprobs,
        adv.logprobs[rows],
        adv.advantages[rows],
        values,
        adv.values[rows],
        adv.returns[rows],
        adv.padding_mask[rows],
        adv.padding_mask_p1[rows],
        cliprange=args.cliprange,
        cliprange_value=args.cliprange_value,
        vf_coef=args.vf_coef,
        counts=counts,
    )


def micro_batch_counts(adv, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``ppo_loss``'s ``counts`` of the whole micro-batch ``rows``: what each piece of it divides by after an
    OOM split, so the pieces' losses and statistics add up to the whole's."""
    pad, p1 = adv.padding_mask[rows], adv.padding_mask_p1[rows]
    return (~pad).sum().clamp_min(1), (~p1).sum().clamp_min(1), pad.numel()


def _add(a, b):
    return type(a)(**{f: getattr(a, f) + getattr(b, f) for f in vars(a)})


class PPOEpochs:
    """The optimisation pass of one update: scored rollout in, device-side statistics out.

    Args:
        args: the PPOConfig (schedule, loss coefficients, temperature).
        accelerator: backward goes through it.
        model: the prepared policy-and-value module.
        pad_token_id: the pad token of the rollouts.
        stepper: steps each micro-batch's window (optimizer, step health, OOM policy).
        generator: draws each epoch's row order (seeded by the trainer; checkpointed with it).
    """

    def __init__(
        self,
        args: PPOConfig,
        accelerator: Accelerator,
        model: PolicyAndValue,
        pad_token_id: int,
        stepper: Stepper,
        generator: torch.Generator,
    ):
        self.args = args
        self.accelerator = accelerator
        self.model = model
        self.pad_token_id = pad_token_id
        self.stepper = stepper
        self.generator = generator
        self._window_rows: dict[int, tuple] = {}  # optimizer step -> its window, for replays

    def optimize(
        self, exp: Experience, train_rows: int, permutations: list[torch.Tensor] | None = None
    ) -> PPOStats:
        """``num_ppo_epochs`` passes of mini-batch PPO over a scored rollout. Returns device-side statistics.

        Args:
            exp: the scored rollout.
            train_rows: rows per training forward (the plan's; merged micro-batches).
            permutations: one row order per epoch (default: drawn from ``generator``).
        """
        stats = new_stats(self.args, train_rows, self.accelerator.device)  # forwards: merged micro-batches
        self.model.train()
        self.stepper.new_update()
        for window in mini_batches(self.args, self.generator, permutations):
            self._train_windows(exp, stats, train_rows, [window])
        # the rollout of the next update uses these weights: verify what is still unverified now
        self._train_windows(exp, stats, train_rows, self._replays(self.stepper.verify_now()))
        self._window_rows = {}
        return stats

    def _train_windows(self, exp, stats, micro, windows) -> None:
        """Run optimizer windows ``(epoch, mini-batch, rows)`` in order, and the windows the step health
        asks to replay after a rollback before anything new."""
        qr, ctx, adv = exp.rollout.query_responses, exp.rollout.queries.shape[1], exp.adv
        queue = list(windows)
        budget = 4 * max(1, self.args.num_ppo_epochs * self.args.num_mini_batches)  # replays per call
        while queue:
            epoch, m, mb_idx = queue.pop(0)
            self._window_rows[self.stepper.window_key()] = (epoch, m, mb_idx)
            before = self.stepper.closed
            for u, start in enumerate(micro_batch_starts(self.args, micro)):
                idx = mb_idx[start : start + micro].to(qr.device)
                out, ent = self._micro_step(qr[idx], ctx, adv, idx)
                stats.record((epoch, m, u), out, ent)
            closed = self.stepper.closed
            # what the step that closed this window undid (or, when none closed here, the latest step)
            rollback = closed.rollback if closed is not before else self.stepper.health.last_rollback()
            replays = self._replays(rollback)
            if replays and budget > 0:
                budget -= len(replays)
                queue[:0] = replays

    def _replays(self, report) -> list:
        """The windows ``(epoch, mini-batch, rows)`` a rollback report asks to run again, in order."""
        if report is None:
            return []
        return [self._window_rows[s] for s in report.replay if s in self._window_rows]

    def _micro_step(self, query_responses, ctx, adv, idx):
        """Forward, loss and backward of one micro-batch, stepped by the stepper.

        A CUDA out-of-memory error splits the micro-batch in halves (recursively, up to
        ``max_oom_splits`` times) with every piece normalised by the whole micro-batch's token counts,
        so the accumulated gradient is the one the whole batch gives and no sample is dropped.
        """

        def forward_backward(chunk, weight):
            if len(chunk["idx"]) == len(idx):  # the whole training forward
                return self._forward_backward(chunk["qr"], ctx, adv, chunk["idx"])
            # a piece: each micro-batch it touches is normalised by that micro-batch's whole counts
            return self._forward_backward(chunk["qr"], ctx, adv, chunk["idx"], idx, chunk["offset"])

        out, entropy = self.stepper.micro_step(
            forward_backward, {"qr": query_responses, "idx": idx, "offset": 0}
        )
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
            # a piece of this micro-batch: its whole counts
            counts = micro_batch_counts(adv, group) if (hi - lo) != (g_hi - g_lo) else None
            part = rows_loss(args, adv, rows, lp[lo:hi], vpred[lo:hi], counts)
            out = part if out is None else _add(out, part)
        groups = -(-len(whole) // args.per_device_train_batch_size)
        if groups > 1:  # the mean over the merged micro-batches
            out = type(out)(**{f: v / groups for f, v in vars(out).items()})
        self.accelerator.backward(out.loss)
        out.loss = out.loss.detach()
        return out, entropy.detach()


def calibrate_precision(plugin, exp: Experience, args, pad_token_id: int) -> None:
    """The precision plugin's sensitivity pass on the first scored rollouts (its per-layer schedule).

    The pass compares each layer in the low precision with an fp32 reference, so it needs fp32
    weights (mixed precision); with weights stored in bf16/fp16 there is nothing to compare with and
    the schedule stays as configured (said once in the log). It differentiates with
    ``torch.autograd.grad`` only: no ``.grad`` is written, so no optimizer hook fires.
    """
    if plugin.calibration_skipped is not None:
        return
    if any(p.dtype != torch.float32 for p in plugin.model.parameters()):
        plugin.calibration_skipped = "the model's weights are not fp32"  # the plugin's own flag: one place
        logger.info("rapidfire: no precision sensitivity pass (%s)", plugin.calibration_skipped)
        return
    ctx = exp.rollout.queries.shape[1]

    def loss_fn(model, batch):  # what training differentiates: log-probs and values of the rollout
        logprobs, values, _ = model(batch["query_responses"], pad_token_id, ctx, args.temperature)
        return -logprobs.mean() + args.vf_coef * values.pow(2).mean()

    rows = exp.rollout.query_responses[: args.per_device_train_batch_size]
    plugin.calibrate({"query_responses": rows}, loss_fn=loss_fn)  # logs the schedule when complete
