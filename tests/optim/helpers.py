"""A small model, deterministic batches and a training loop shared by the optimizer tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return (model(x) - y).pow(2).mean()


def two_groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    """Weights with weight decay, biases without (the usual LLM split)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train(
    model: nn.Module,
    opt,
    batches: list[int],
    accumulation: int = 1,
    clip: float | None = None,
    sched=None,
    inject: Callable | None = None,
    replay: bool = False,
):
    """The plain loop: ``accumulation`` backwards per step over consecutive batch ids.

    ``inject(step, loss, model) -> loss`` can corrupt a step; ``replay`` re-runs a skipped step's batches
    once, the same data (what a trainer does to redo a batch after a clip-prediction miss).
    """
    steps = [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]
    for step, ids in enumerate(steps):
        for _attempt in range(2 if replay else 1):
            for i in ids:
                loss = loss_of(model, i)
                if inject is not None:
                    loss = inject(step, loss, model)
                if hasattr(opt, "observe_loss"):
                    opt.observe_loss(loss)
                (loss / accumulation).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            if not getattr(opt, "last_step_skipped", False):
                break
        if sched is not None and not getattr(opt, "last_step_skipped", False):
            sched.step()
    return model


def adamw_reference(steps: int, skipped=()) -> nn.Module:
    """The plain reference: ``make_model()`` trained by torch AdamW (lr 1e-2, foreach) on batches
    ``0..steps-1`` except ``skipped`` (the steps a RapidFireOptimizer run dropped)."""
    model = make_model()
    train(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
        [i for i in range(steps) if i not in skipped],
    )
    return model


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    """Bit-exact equality, with the largest difference in the message when it fails."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if not torch.equal(pa, pb):
            diff = (pa - pb).abs().max().item()
            raise AssertionError(f"{name} differs: max |diff| = {diff:.3e}")
