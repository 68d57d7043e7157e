"""OOM split-and-retry inside ``training_step`` of a ``transformers.Trainer`` or TRL trainer.

``install_oom_recovery`` gives the trainer a class of its own (same name) whose method resolution order
puts :class:`OOMSplitTrainingStep` just before ``transformers.Trainer``. Its ``training_step`` therefore
runs below every override (TRL's GRPO counts its steps there) and every instance wrapper: it prepares
the inputs once (GRPO generates there), then runs ``Trainer.training_step`` on them under
:class:`rapidfire_hf.memory.OOMRecovery`. An OOM splits the prepared micro-batch in halves; each piece's
loss is weighted so the pieces' gradients add up to the whole micro-batch's, and all pieces but the last
run with accelerate's ``sync_gradients`` off, so the gradient pipeline, DeepSpeed's step and DDP's
all-reduce close the window once. Preference batches (DPO, reward) are split by pairs, keeping each
chosen row with its rejected row; TRL trainers not known to have per-sample losses are not split (their
OOM is raised as an ``OOMRecoveryError`` that says what to lower).
"""

from __future__ import annotations

import contextlib
import operator

import torch
from transformers import Trainer

from rapidfire_hf.integrations.parts import STATE_ATTR, installed_parts
from rapidfire_hf.memory.oom import (
    OOMRecovery,
    OOMRecoveryError,
    accelerate_hold,
    batch_size,
    split_batch,
)

ADVICE = (
    "Lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch), set "
    "gradient_checkpointing=True, or shorten the sequences (max_length / max_completion_length)."
)
# TRL's GRPO/RLOO loss types by what their loss divides by: a count fixed for the whole window (the
# pieces' losses add up), the micro-batch's completion tokens; any other type is a mean over sequences.
WINDOW_NORMALISED = frozenset({"dapo", "cispo", "vespo"})
TOKEN_MEAN = frozenset({"bnpo"})
_MISSING = object()
# Trainers whose batch rows are independent samples (split anywhere) or chosen/rejected pairs stacked as
# [chosen rows; rejected rows] (a piece keeps each pair whole). Other TRL trainers are not split: their
# losses may mix rows (KTO's batch KL, for one), so a split could change the update.
ROW_TRAINERS = frozenset({"SFTTrainer", "GRPOTrainer", "RLOOTrainer"})
PAIR_TRAINERS = frozenset({"DPOTrainer", "RewardTrainer"})


def split_layout(trainer) -> str | None:
    """``"rows"``, ``"pairs"`` or None (not split) for this trainer's micro-batches.

    A trainer outside TRL is taken as rows (``transformers.Trainer``'s own losses are per-sample).
    """
    names = {cls.__name__ for cls in type(trainer).__mro__}
    if names & PAIR_TRAINERS:
        return "pairs"
    if names & ROW_TRAINERS:
        return "rows"
    trl_classes = [c for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"]
    return None if trl_classes else "rows"


def pair_count(batch) -> int:
    """Chosen/rejected pairs of a preference batch (``input_ids`` holds 2 rows per pair)."""
    return batch["input_ids"].shape[0] // 2


def split_pairs(batch) -> tuple[dict, dict]:
    """Halves of a preference batch that keep each chosen row with its rejected row.

    Values of 2P rows (``input_ids``, masks) give rows ``[:c] + [P:P+c]`` and the rest; values of P rows
    (``ref_chosen_logps``, ``margin``) are cut at ``c``; anything else goes to both halves.
    """
    pairs = pair_count(batch)
    cut = (pairs + 1) // 2
    first, second = {}, {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2 * pairs:
            first[key] = torch.cat([value[:cut], value[pairs : pairs + cut]])
            second[key] = torch.cat([value[cut:pairs], value[pairs + cut :]])
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == pairs:
            first[key], second[key] = value[:cut], value[cut:]
        else:
            first[key] = second[key] = value
    return first, second


def _count(chunk, key: str) -> float:
    value = chunk[key]
    if key == "labels":  # causal LM labels: the shifted targets that are not ignored
        return float((value[..., 1:] != -100).sum())
    return float(value.sum())


def split_weight(trainer, batch, num_items_in_batch):
    """``weight_fn`` for :class:`OOMRecovery` that makes a piece's share of the loss exact.

    1 when the loss is normalised by a count of the whole window (``num_items_in_batch`` reaching a
    model that accepts it, a ``compute_loss_func``, GRPO's ``dapo``-like types); the share of completion
    tokens for a token mean over the micro-batch (``bnpo``); the share of label tokens for a model's own
    token-mean loss; else the share of sequences.
    """
    loss_type = getattr(trainer, "loss_type", None)
    loss_type = loss_type if isinstance(loss_type, str) else None
    scaled = (
        getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
    ) or getattr(trainer, "compute_loss_func", None) is not None
    if loss_type in WINDOW_NORMALISED or (loss_type is None and scaled):
        return lambda chunk, total: 1.0
    key = None
    if loss_type in TOKEN_MEAN and "completion_mask" in batch:
        key = "completion_mask"
    elif loss_type is None and isinstance(batch, dict) and "labels" in batch:
        key = "labels"
    if key is None:
        return None  # OOMRecovery's default: the share of sequences
    whole = max(_count(batch, key), 1.0)
    return lambda chunk, total: _count(chunk, key) / whole


@contextlib.contextmanager
def _instance_override(obj, name: str, value):
    """``obj.name`` is ``value`` inside (an instance attribute), as before afterwards."""
    saved = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, saved)


class OOMSplitTrainingStep(Trainer):
    """``training_step`` with OOM split-and-retry; placed just before ``Trainer`` in the trainer's MRO."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        recovery = _recovery(self)
        parent = super().training_step
        layout = split_layout(self)
        if layout is None:
            try:
                return parent(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError as err:
                raise OOMRecoveryError(
                    f"out of memory in a micro-batch of {type(self).__name__}, whose batches rapidfire_hf does not "
                    f"split (its loss may mix rows). {ADVICE}"
                ) from err
        model.train()  # as Trainer.training_step does first: GRPO/RLOO read the mode in _prepare_inputs
        prepared = self._prepare_inputs(inputs)  # once: GRPO/RLOO generate or take their buffer here
        compute_loss = self.compute_loss

        def step(chunk, weight):
            def weighted_loss(*args, **kwargs):
                return compute_loss(*args, **kwargs) * weight

            with contextlib.ExitStack() as stack:
                stack.enter_context(_instance_override(self, "_prepare_inputs", lambda batch: batch))
                if weight != 1.0:
                    stack.enter_context(_instance_override(self, "compute_loss", weighted_loss))
                return parent(model, chunk, num_items_in_batch)

        if layout == "pairs":  # DPO / reward losses: means over pairs
            recovery.split_fn, recovery.size_fn = split_pairs, pair_count
            recovery.weight_fn = _sample_share(recovery)
        else:
            recovery.split_fn, recovery.size_fn = split_batch, batch_size
            recovery.weight_fn = split_weight(self, prepared, num_items_in_batch) or _sample_share(recovery)
        recovery.hold = lambda: accelerate_hold(self.accelerator, model)
        return recovery(step, prepared)


def _sample_share(recovery: OOMRecovery):
    return lambda chunk, total: recovery.size_fn(chunk) / total


def _recovery(trainer) -> OOMRecovery:
    recovery = installed_parts(trainer).get("oom")
    if recovery.optimizer is None:  # the trainer builds its optimizer in train()
        recovery.optimizer = trainer.optimizer
    return recovery


def install_oom_recovery(trainer, max_splits: int = 3) -> str:
    """Give ``trainer`` the OOM split of :class:`OOMSplitTrainingStep`; returns a line for the summary log."""
    base = type(trainer)
    if not issubclass(base, OOMSplitTrainingStep):
        # a plain Trainer: OOMSplitTrainingStep alone (it derives from Trainer); a subclass: its own
        # training_step first, then the split, then Trainer's
        bases = (OOMSplitTrainingStep,) if base is Trainer else (base, OOMSplitTrainingStep)
        trainer.__class__ = type(
            base.__name__,
            bases,
            {"__module__": base.__module__, "__qualname__": base.__qualname__},
        )
    memory = installed_parts(trainer).get("memory")
    release = (lambda: memory.compact("oom_split")) if memory is not None else None
    recovery = OOMRecovery(
        max_splits=max_splits,
        params=[p for p in trainer.model.parameters() if p.requires_grad],
        combine=operator.add,  # each piece's returned loss is already weighted
        release=release,
        telemetry=getattr(memory, "telemetry", None),
        advice=ADVICE,
    )
    getattr(trainer, STATE_ATTR).parts["oom"] = recovery
    return f"OOM split-and-retry in training_step (up to {max_splits} halvings)"


__all__ = ["OOMSplitTrainingStep", "install_oom_recovery", "split_layout", "split_pairs", "split_weight"]
