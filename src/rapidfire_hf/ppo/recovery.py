"""Recovery from CUDA out-of-memory errors inside a PPO micro-batch (a mixin of PPOTrainer).

The micro-batch is split in halves, recursively, and every piece's loss is normalised by the token
counts of the whole micro-batch (``ppo_loss(counts=...)``), so the accumulated gradient equals the
one the whole micro-batch gives and no sample is dropped. Gradients created by the failed attempt
are removed first; a failure in a backward that adds into existing gradients (or that a gradient
pipeline already applied) cannot be undone exactly and is refused with a clear error.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class OOMRecoveryMixin:
    """Split-and-retry for ``PPOTrainer._micro_step``; needs ``_forward_backward`` and trainer state."""

    def _recover_from_oom(self, err, query_responses, ctx, adv, idx, counts, depth):
        """Free what the failed attempt held, then run the two halves of the micro-batch."""
        args = self.args
        if depth > args.max_oom_splits or len(idx) < 2:
            raise RuntimeError(
                f"CUDA out of memory in a PPO micro-batch even after {depth - 1} split(s) down to {len(idx)} "
                "row(s): lower per_device_train_batch_size or response_length, or set "
                "memory.optimization='aggressive' (activation checkpointing)."
            ) from err
        self._drop_partial_grads()
        if self.memory_callback is not None:
            self.memory_callback.compact("oom_split")
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.warning("CUDA out of memory in a micro-batch of %d rows: retrying in halves", len(idx))
        self._oom_splits += 1
        pieces = []
        for half in range(2):
            sl = slice(0, (len(idx) + 1) // 2) if half == 0 else slice((len(idx) + 1) // 2, None)
            try:
                pieces.append(self._forward_backward(query_responses[sl], ctx, adv, idx[sl], counts))
            except torch.OutOfMemoryError as inner:
                pieces.append(
                    self._recover_from_oom(inner, query_responses[sl], ctx, adv, idx[sl], counts, depth + 1)
                )
        outs, ents = zip(*pieces)
        merged = {f: sum(getattr(o, f) for o in outs) for f in vars(outs[0])}  # additive by construction
        return type(outs[0])(**merged), torch.cat(ents)

    def _drop_partial_grads(self):
        """Undo gradients a failed backward created; refuse when it may have added to existing ones."""
        if not self._in_backward:  # the OOM came in forward: no gradient was touched
            return
        self._in_backward = False
        if self._rf_opt is not None and self._rf_opt.pipeline_enabled:
            raise RuntimeError(
                "CUDA out of memory during a pipelined backward: some parameters may already be updated. "
                "Lower per_device_train_batch_size or disable the gradient pipeline."
            )
        for p, had in zip(self._trainable, self._had_grad):
            if p.grad is not None and not had:
                p.grad = None
            elif had:
                raise RuntimeError(
                    "CUDA out of memory during a backward that accumulates into existing gradients; "
                    "the partial sum cannot be undone exactly. Lower per_device_train_batch_size."
                )
