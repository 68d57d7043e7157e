"""Out-of-memory policies of PPOTrainer: training micro-batches (used by the stepper), generation and scoring.

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

from rapidfire_hf.memory.oom import OOMRecovery, run_in_chunks

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


def train_recovery(
    max_splits: int, params: list[torch.Tensor], optimizer, hold: Callable, release: Callable[[], int] | None
) -> OOMRecovery:
    """The split-and-retry policy of training micro-batches: pieces of a chunk ``{"qr", "idx", "offset"}``,
    each loss normalised by the whole micro-batch (``ppo_loss(counts=...)``), so every piece weighs 1."""
    return OOMRecovery(
        max_splits=max_splits,
        params=params,
        split_fn=_split_rows,
        size_fn=lambda chunk: len(chunk["idx"]),
        weight_fn=lambda chunk, total: 1.0,  # ppo_loss(counts=...) normalises by the whole micro-batch
        combine=_merge_pieces,
        hold=hold,
        release=release,
        optimizer=optimizer,
        advice=TRAIN_ADVICE,
    )


class NoGradChunks:
    """Generation and scoring in chunks of rows, halving the chunk after each OOM
    (:func:`rapidfire_hf.memory.oom.run_in_chunks`: the RNG is put back before a retry).

    Args:
        device: where the chunks run (its RNG is put back too).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.oom_retries = 0  # chunks retried smaller after an OOM so far

    def run(
        self,
        run: Callable[[int, int], object],
        n: int,
        chunk: int,
        what: str,
        setting: str,
        on_oom: Callable[[], None] | None = None,
    ) -> list:
        """``[run(start, stop) for consecutive chunks of n rows]``; ``setting`` names the option that sets
        ``chunk``, for the message."""

        def count_and_release():
            self.oom_retries += 1
            if on_oom is not None:
                on_oom()

        return run_in_chunks(
            run,
            n,
            chunk,
            f"{what} ({setting}={chunk})",
            on_oom=count_and_release,
            device=self.device,
            advice="Lower response_length or max_prompt_length.",
        )
