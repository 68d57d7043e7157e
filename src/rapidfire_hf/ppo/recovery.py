"""Out-of-memory policies of PPOTrainer: training micro-batches (used by the stepper), generation and scoring.

Training: :class:`rapidfire_hf.memory.OOMRecovery` splits a micro-batch that runs out of memory in
halves, recursively. Every piece's loss is normalised by the token counts of the whole micro-batch
(``ppo_loss(counts=...)``), so the pieces' gradients add up to the whole micro-batch's and no sample is
dropped; all pieces but the last run with accelerate's ``sync_gradients`` off, so the window is closed
(gradient pipeline hooks, DeepSpeed step, DDP all-reduce) once, by the last piece. PPOTrainer's chunk is
one micro-batch (:func:`train_recovery`); a sweep's is a pack of several trials' micro-batches sharing one
forward (:func:`pack_recovery`, pieces of :class:`PackRows`), split the same way by rows.

Generation and scoring run without gradients: a chunk that runs out of memory is retried in halves
(the global RNG is put back first, so the retry draws as a run with the smaller chunk would), and the
smaller size is kept for the rest of that phase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rapidfire_hf.memory.oom import OOMRecovery, batch_size, run_in_chunks, unit_weight

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
    max_splits: int,
    params: list[torch.Tensor],
    optimizer,
    hold: Callable | None,
    release: Callable[[], int] | None,
    *,
    split_fn: Callable = _split_rows,
    combine: Callable = _merge_pieces,
    size_fn: Callable = batch_size,
    advice: str = TRAIN_ADVICE,
) -> OOMRecovery:
    """The split-and-retry policy of training micro-batches: by default pieces of PPOTrainer's chunk
    ``{"qr", "idx", "offset"}`` (its size: the rows of ``qr``, one per ``idx``), each loss normalised by the
    whole micro-batch (``ppo_loss(counts=...)``), so every piece weighs 1. ``split_fn`` / ``combine`` / ``size_fn`` give another chunk layout the same policy
    (:func:`pack_recovery`)."""
    return OOMRecovery(
        max_splits=max_splits,
        params=params,
        split_fn=split_fn,
        size_fn=size_fn,
        weight_fn=unit_weight,  # ppo_loss(counts=...) normalises by the whole micro-batch
        combine=combine,
        hold=hold,
        release=release,
        optimizer=optimizer,
        advice=advice,
    )


@dataclass(frozen=True)
class PackRows:
    """Rows of one micro-batch in a packed training forward (a sweep: one per trial of the micro-step).

    ``rows`` are ``micro_batch[offset : offset + len(rows)]``: the whole micro-batch (``offset`` 0, same
    length) or a piece of it after an OOM split, whose loss is then normalised by the whole's counts.
    """

    key: int  # whose micro-batch (the caller's index, e.g. the trial's position)
    micro_batch: torch.Tensor  # [m] row indices of the whole micro-batch
    offset: int = 0
    length: int | None = None  # rows taken from offset (None: to the end)

    @property
    def rows(self) -> torch.Tensor:
        return self.micro_batch[self.offset : self.offset + len(self)]

    @property
    def whole(self) -> bool:
        return self.offset == 0 and len(self) == len(self.micro_batch)

    def __len__(self) -> int:
        return self.length if self.length is not None else len(self.micro_batch) - self.offset


def split_pack(pack: list[PackRows]) -> tuple[list[PackRows], list[PackRows]]:
    """A pack cut in two by rows (the first half gets the odd row); a micro-batch across the cut is cut too."""
    cut = (sum(len(p) for p in pack) + 1) // 2
    first, second, seen = [], [], 0
    for p in pack:
        n = len(p)
        if seen + n <= cut:
            first.append(p)
        elif seen >= cut:
            second.append(p)
        else:
            k = cut - seen
            first.append(PackRows(p.key, p.micro_batch, p.offset, k))
            second.append(PackRows(p.key, p.micro_batch, p.offset + k, n - k))
        seen += n
    return first, second


def _merge_packs(a: dict, b: dict) -> dict:
    """``{key: (LossOutput, entropy rows)}`` of two pieces: losses of a micro-batch in both add up."""
    out = dict(a)
    for key, result in b.items():
        out[key] = _merge_pieces(out[key], result) if key in out else result
    return out


def pack_recovery(
    max_splits: int, params: list[torch.Tensor], release: Callable[[], int] | None = None, advice: str = ""
) -> OOMRecovery:
    """:func:`train_recovery`'s policy for packed forwards: a chunk is a list of :class:`PackRows`, the step
    function returns ``{key: (LossOutput, entropy rows)}`` with each piece's loss normalised by its whole
    micro-batch (``ppo_loss(counts=...)``), so the gradients of the pieces add up to the whole pack's."""
    return train_recovery(
        max_splits,
        params,
        None,
        None,
        release,
        split_fn=split_pack,
        combine=_merge_packs,
        size_fn=lambda pack: sum(len(p) for p in pack),
        advice=advice or TRAIN_ADVICE,
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
        next_stop: Callable[[int, int], int] | None = None,
    ) -> list:
        """``[run(start, stop) for consecutive chunks of n rows]``; ``setting`` names the option that sets
        ``chunk``, for the message; ``next_stop`` as in :func:`~rapidfire_hf.memory.oom.run_in_chunks`."""

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
            next_stop=next_stop,
        )
