"""The gradient pipeline: step each parameter as soon as its gradient is complete, then free it.

On the backward that closes an accumulation window, ``Tensor.register_post_accumulate_grad_hook``
fires once per parameter right after its ``.grad`` has received the last contribution; the hook steps
that parameter with the inner optimizer and sets ``.grad = None``. The update overlaps the rest of
backward and a full gradient buffer never exists on that step. Other micro-steps accumulate as usual.

Which backward closes a window:

* ``accumulation_steps=N`` given: each parameter counts the backwards that reached it since the last
  ``step()``; the N-th closes its window (``step()`` resets the counts).
* otherwise, when accelerate's ``GradientState`` exists (an ``Accelerator`` was created): its
  ``sync_gradients`` flag, which ``accelerator.accumulate()`` and ``transformers.Trainer`` set for
  the micro-step that closes the window.
* otherwise every backward closes a window (the plain ``backward(); step()`` loop).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from rapidfire_hf.optim.inner import make_steppers


def accelerate_flag(name: str, state_class: str = "GradientState"):
    """A field of accelerate's shared state, or None when accelerate has not initialised it.

    Reads the shared dict directly: the hooks call this once per parameter, and constructing
    ``GradientState()`` each time would cost more than the lookup.
    """
    module = sys.modules.get("accelerate.state")
    if module is None:
        return None
    shared = getattr(module, state_class)._shared_state
    return shared.get(name) if shared else None


class GradientPipeline:
    """Hooks that step parameters during backward, for one inner optimizer.

    Args:
        plan_window: called at the first closing hook of a window; returns True to step parameters in
            the hooks for this window, False to leave the gradients for ``step()`` (deferred window).
        accumulation_steps: explicit window length in backwards, or None (see module docstring).
        need_norms: whether the hooks record each gradient's norm before stepping (for clipping checks
            and health rules).
    """

    def __init__(self, plan_window: Callable[[], bool], accumulation_steps: int | None, need_norms: bool):
        self.plan_window = plan_window
        self.accumulation_steps = accumulation_steps
        self.need_norms = need_norms
        self.enabled = True
        self.hook_seconds = 0.0
        self._handles: list = []
        self._order: dict[torch.Tensor, int] = {}
        self._steppers: dict = {}
        self._counts: dict[torch.Tensor, int] = {}
        self._plan: bool | None = None
        self.stepped: set[torch.Tensor] = set()
        self.norms: dict[int, torch.Tensor] = {}

    @property
    def window_pipelined(self) -> bool:
        """Whether parameters were (or will be) stepped in the hooks in the current window."""
        return bool(self._plan)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Register hooks on the parameters of ``optimizer`` that have none yet, and (re)build steppers."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in self._order:
                    continue
                self._order[p] = len(self._order)
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
        self.rebuild(optimizer)

    def rebuild(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild the per-parameter steppers (after ``load_state_dict`` replaced state and groups)."""
        self._steppers = make_steppers(optimizer)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._order = [], {}

    def _closes_window(self, p: torch.Tensor) -> bool:
        if self.accumulation_steps is not None:
            n = self._counts[p] = self._counts.get(p, 0) + 1
            return n >= self.accumulation_steps
        sync = accelerate_flag("sync_gradients")
        return True if sync is None else bool(sync)

    def _hook(self, p: torch.Tensor) -> None:
        if not self._closes_window(p) or not self.enabled:
            return
        if self._plan is None:
            self._plan = self.plan_window()
        if self._plan:
            start = time.perf_counter()
            self.step_param(p)
            self.hook_seconds += time.perf_counter() - start

    def step_param(self, p: torch.Tensor) -> None:
        """Step ``p`` with the inner optimizer and free its gradient."""
        if self.need_norms:
            self.norms[self._order[p]] = torch.linalg.vector_norm(p.grad)
        self._steppers[p].step()
        p.grad = None
        self.stepped.add(p)

    def leftovers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Parameters that still hold a gradient this window (their hook did not fire on the closing step)."""
        return [p for p in params if p.grad is not None and p not in self.stepped]

    def ordered_norms(self) -> list[torch.Tensor]:
        return [self.norms[i] for i in sorted(self.norms)]

    def reset_window(self) -> None:
        self._counts.clear()
        self._plan = None
        self.stepped.clear()
        self.norms.clear()
