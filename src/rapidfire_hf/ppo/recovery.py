"""Out-of-memory recovery for PPOTrainer (a mixin): training micro-batches, generation and scoring.

Training: :class:`rapidfire_hf.memory.OOMRecovery` splits a micro-batch that runs out of memory in
halves, recursively. Every piece's loss is normalised by the token counts of the whole micro-batch
(``ppo_loss(counts=...)``), so the pieces' gradients add up to the whole micro-batch's and no sample is
dropped; all pieces but the last run with accelerate's ``sync_gradients`` off, so the window is closed
(gradient pipeline hooks, DeepSpeed step, DDP all-reduce) once, by the last piece.

Generation and scoring run without gradients: a chunk that runs out of memory is retried in halves
(the global RNG is put back first, so the retry draws as a run with the smaller chunk would), and the
smaller size is kept for the rest of that phase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rapidfire_hf.memory.oom import OOMRecovery, accelerate_hold, run_in_chunks

logger = logging.getLogger(__name__)

TRAIN_ADVICE = (
    "Lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch), lower "
    "response_length, set gradient_checkpointing=True, or raise max_oom_splits."
)


def _split_rows(chunk: dict) -> tuple[dict, dict]:
    cut = (len(chunk["idx"]) + 1) // 2
    offset = chunk.get("offset", 0)
    return (
        {"qr": chunk["qr"][:cut], "idx": chunk["idx"][:cut], "offset": offset},
        {"qr": chunk["qr"][cut:], "idx": chunk["idx"][cut:], "offset": offset + cut},
    )


def _merge_pieces(a, b):
    """Loss statistics are sums over pieces (each normalised by the whole micro-batch); entropies stack."""
    (out_a, ent_a), (out_b, ent_b) = a, b
    merged = {f: getattr(out_a, f) + getattr(out_b, f) for f in vars(out_a)}
    return type(out_a)(**merged), torch.cat([ent_a, ent_b])


class OOMRecoveryMixin:
    """OOM handling of ``PPOTrainer``; needs ``args``, ``accelerator``, ``model``, ``optimizer``."""

    def _make_oom_recovery(self) -> OOMRecovery:
        release = None
        if self.memory_callback is not None:
            release = lambda: self.memory_callback.compact("oom_split")  # noqa: E731
        return OOMRecovery(
            max_splits=self.args.max_oom_splits,
            params=self._trainable,
            split_fn=_split_rows,
            size_fn=lambda chunk: len(chunk["idx"]),
            weight_fn=lambda chunk, total: 1.0,  # ppo_loss(counts=...) normalises by the whole micro-batch
            combine=_merge_pieces,
            hold=lambda: accelerate_hold(self.accelerator, self.model),
            release=release,
            optimizer=self.optimizer,
            advice=TRAIN_ADVICE,
        )

    @property
    def _oom_splits(self) -> int:
        """Micro-batch splits after an OOM so far (``rapidfire/oom_splits``)."""
        recovery = getattr(self, "_oom_recovery", None)
        return len(recovery.events) if recovery is not None else 0

    def _forward_backward_recovering(self, query_responses, ctx, adv, idx):
        """``_forward_backward`` of one micro-batch, split in pieces on OOM; ``(LossOutput, entropy)``."""
        if getattr(self, "_oom_recovery", None) is None:
            self._oom_recovery = self._make_oom_recovery()

        def step(chunk, weight):
            if len(chunk["idx"]) == len(idx):  # the whole training forward
                return self._forward_backward(chunk["qr"], ctx, adv, chunk["idx"])
            # a piece: each micro-batch it touches is normalised by that micro-batch's whole counts
            return self._forward_backward(chunk["qr"], ctx, adv, chunk["idx"], idx, chunk["offset"])

        return self._oom_recovery(step, {"qr": query_responses, "idx": idx, "offset": 0})

    def _no_grad_in_chunks(
        self,
        run: Callable[[int, int], object],
        n: int,
        chunk: int,
        what: str,
        setting: str,
        on_oom: Callable[[], None] | None = None,
    ):
        """``[run(start, stop) for consecutive chunks of n rows]``, halving the chunk after each OOM
        (:func:`rapidfire_hf.memory.oom.run_in_chunks`: the RNG is put back before a retry)."""

        def count_and_release():
            self._no_grad_oom_retries = getattr(self, "_no_grad_oom_retries", 0) + 1
            if on_oom is not None:
                on_oom()

        return run_in_chunks(
            run,
            n,
            chunk,
            f"{what} ({setting}={chunk})",
            on_oom=count_and_release,
            device=self.accelerator.device,
            advice="Lower response_length or max_prompt_length.",
        )
