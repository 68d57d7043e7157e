"""The gradient pipeline: step buckets of parameters as soon as their gradients are complete, then free them.

On the backward that closes an accumulation window, ``Tensor.register_post_accumulate_grad_hook``
fires once per parameter right after its ``.grad`` has received the last contribution. Parameters are
grouped into buckets of about ``bucket_mb`` MiB of gradient (within one param group and device, in the
order their gradients become ready); when the last gradient of a bucket is complete, its hook steps the
whole bucket with one call of the inner optimizer (one multi-tensor kernel for a foreach/fused AdamW),
computes the bucket's gradient norms with one ``torch._foreach_norm`` when norms are needed, and sets
the bucket's ``.grad`` to None. The update overlaps the rest of backward and a full gradient buffer
never exists on that step. Other micro-steps accumulate as usual.

Bucket order: before the first closing window, reverse registration order (the usual order of
gradients in backward); the hook order observed in the first closing window then replaces it (the
buckets are re-cut once, at the end of that window; parameters that did not receive a gradient there
go to buckets of their own, so an unused parameter never holds back a bucket of used ones).

Parameters whose hook did not fire in a window (not reached by the closing backward, or in a bucket
that did not complete) are stepped in ``step()`` by :meth:`GradientPipeline.step_leftovers`, one inner
call per bucket. Stepping per bucket gives bit-for-bit the result of one inner ``step()`` over all
parameters, for any optimizer whose update of a parameter reads only that parameter's gradient and
state (AdamW, SGD, bitsandbytes' 8-bit optimizers, ...).

Which backward closes a window:

* ``accumulation_steps=N`` given: each parameter counts the backwards that reached it since the last
  ``step()``; the N-th closes its window (``step()`` resets the counts).
* otherwise, when accelerate's ``GradientState`` exists (an ``Accelerator`` was created): its
  ``sync_gradients`` flag, which ``accelerator.accumulate()`` and ``transformers.Trainer`` set for
  the micro-step that closes the window.
* otherwise every backward closes a window (the plain ``backward(); step()`` loop).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from rapidfire_hf.optim.inner import BucketStepper, grad_nbytes, plan_buckets
from rapidfire_hf.utils.units import MIB


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


# GradientPipeline.stats() of an optimizer without a pipeline
NO_PIPELINE_STATS = {
    "hook_seconds": 0.0,
    "pipeline_buckets": 0,
    "early_buckets": 0,
    "hook_bucket_steps": 0,
    "bucket_steps": 0,
}


def check_bucket_mb(value) -> float:
    """``pipeline_bucket_mb`` as a float, or a ValueError that says what is allowed."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"pipeline_bucket_mb={value!r}: must be a finite number of MiB >= 0 (the gradient bytes the "
            "pipeline steps at once; 0 steps each parameter on its own)."
        )
    return float(value)


def check_overlap(value) -> float:
    """``pipeline_overlap`` as a float in [0, 1] (True = 1, False = 0), or a ValueError."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"pipeline_overlap={value!r}: must be a number from 0 (every bucket step on the backward "
            "stream) to 1 (every bucket step on a side CUDA stream), or True/False."
        )
    return float(value)


def check_share(value) -> float:
    """``pipeline_share`` as a float in [0, 1], or a ValueError that says what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"pipeline_share={value!r}: must be a number from 0 (no bucket stepped inside backward) to 1 "
            "(every bucket stepped as soon as its gradients are complete)."
        )
    return float(value)


def check_depth(value) -> int | None:
    """``pipeline_depth`` as an int >= 1 or None, or a ValueError that says what is allowed."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"pipeline_depth={value!r}: must be an int >= 1 or None (no limit)")
    return value


class Bucket:
    """Parameters of one param group (and device) stepped together: one inner call, one norm call."""

    __slots__ = ("index", "group_index", "params", "stepper", "hooked", "side", "early")

    def __init__(self, index: int, group_index: int, stepper: BucketStepper, hooked: int):
        self.side = False  # stepped on the side stream (GradientPipeline overlap)
        self.early = True  # may be stepped inside backward (GradientPipeline share and depth)
        self.index = index
        self.group_index = group_index
        self.stepper = stepper
        self.params = stepper.params
        self.hooked = hooked  # members with a hook: the bucket completes when that many have fired

    def __repr__(self) -> str:
        nbytes = sum(p.numel() * p.element_size() for p in self.params)
        return f"Bucket({self.index}, group={self.group_index}, params={len(self.params)}, mib={nbytes / MIB:.2f})"


class GradientPipeline:
    """Hooks that step buckets of parameters during backward, for one inner optimizer.

    Args:
        plan_window: called at the first closing hook of a window; returns True to step parameters in
            the hooks for this window, False to leave the gradients for ``step()`` (deferred window).
        accumulation_steps: explicit window length in backwards, or None (see module docstring).
        need_norms: whether the hooks record each gradient's norm before stepping (for clipping checks
            and health rules).
        bucket_mb: MiB of gradient per bucket (0: one parameter per bucket).
        learn_order: re-cut the buckets once from the hook order of the first closing window.
        overlap: share (0 to 1) of the gradient bytes, counted over the buckets in the order their
            gradients complete, whose bucket steps run on a CUDA side stream, so that the
            (memory-bound) optimizer kernels can run next to the (compute-bound) rest of backward
            instead of after it in the same stream; the last buckets of backward have little left to
            overlap with and stay on the backward stream below 1. The side stream waits for everything
            the backward stream enqueued before the bucket's last gradient, and :meth:`join` makes the
            backward stream wait for the side stream
            (``RapidFireOptimizer.step()`` joins before it reads norms or the next forward can start).
            Freed gradients are recorded on the side stream so the allocator does not hand their memory
            to the backward stream before the step that reads them ran. No effect on the CPU.
        max_in_flight: with ``overlap``, bucket steps that may be queued on the side stream before the
            backward stream waits for them (a device-side wait, no host sync); bounds the gradient
            memory still held for queued steps. None: no limit until ``join()``.
        share: share (0 to 1) of the gradient bytes, counted over the buckets in the order their
            gradients complete, whose buckets are stepped inside backward ("early" buckets: a bucket is
            early when the bytes before it are below ``share`` of the total). The other buckets keep
            their gradients until ``step()``, which steps them after the window is verified.
        depth: at most this many early buckets (the first ones of backward); None: no limit.
    """

    def __init__(
        self,
        plan_window: Callable[[], bool],
        accumulation_steps: int | None,
        need_norms: bool,
        bucket_mb: float = 256.0,
        learn_order: bool = True,
        overlap: float = 0.0,
        max_in_flight: int | None = None,
        share: float = 1.0,
        depth: int | None = None,
    ):
        self.overlap = check_overlap(overlap)
        self.share = check_share(share)
        self.depth = check_depth(depth)
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"pipeline_depth={max_in_flight!r}: must be an int >= 1 or None (no limit)")
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: set[torch.device] = set()
        self.plan_window = plan_window
        self.accumulation_steps = accumulation_steps
        self.need_norms = need_norms
        self.grad_scale = 1.0  # gradients are multiplied by this before each bucket steps (clip prediction)
        self.bucket_bytes = check_bucket_mb(bucket_mb) * MIB
        self.enabled = True
        self.hook_seconds = 0.0
        self.bucket_steps = 0  # inner step() calls made for buckets (hooks and leftovers)
        self.hook_bucket_steps = 0  # of which inside backward (in the hooks)
        self.buckets: list[Bucket] = []
        self._inner: torch.optim.Optimizer | None = None
        self._lock = threading.Lock()
        self._handles: list = []
        self._order: dict[torch.Tensor, int] = {}
        self._hooked: set[torch.Tensor] = set()
        self._bucket_of: dict[torch.Tensor, Bucket] = {}
        self._learning = learn_order
        self._learned: list[torch.Tensor] | None = None
        self._seen: list[torch.Tensor] = []
        self._counts: dict[torch.Tensor, int] = {}
        self._plan: bool | None = None
        self._fired: dict[int, set[torch.Tensor]] = {}
        self._done: set[int] = set()
        self.stepped: set[torch.Tensor] = set()
        self.norms: dict[int, torch.Tensor] = {}

    @property
    def window_pipelined(self) -> bool:
        """Whether parameters were (or will be) stepped in the hooks in the current window."""
        return bool(self._plan)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Register hooks on the parameters of ``optimizer`` that have none yet, and (re)build buckets."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in self._order:
                    continue
                self._order[p] = len(self._order)
                if p.requires_grad:
                    self._hooked.add(p)
                    self._handles.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))
        self.rebuild(optimizer)

    def rebuild(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-cut the buckets and rebuild their steppers (after ``load_state_dict`` replaced state and
        groups, a new param group, or once the gradient order was observed)."""
        self._inner = optimizer
        segments = [self._learned] if self._learned is not None else []
        buckets = []
        for gi, params in plan_buckets(optimizer, segments, self.bucket_bytes, self._hooked.__contains__):
            stepper = BucketStepper(optimizer, optimizer.param_groups[gi], params)
            buckets.append(Bucket(len(buckets), gi, stepper, sum(p in self._hooked for p in params)))
        total = sum(grad_nbytes(p) for b in buckets for p in b.params)
        done = 0
        early = 0
        for b in buckets:  # the first `overlap` share of the bytes, in gradient order, on the side stream
            before = done
            done += sum(grad_nbytes(p) for p in b.params)
            b.side = self.overlap > 0 and done <= self.overlap * total + 0.5
            b.early = (
                bool(b.hooked) and before < self.share * total and (self.depth is None or early < self.depth)
            )
            early += b.early
        self.buckets = buckets
        self._bucket_of = {p: b for b in buckets for p in b.params}
        self._fired.clear()
        self._done.clear()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._order, self._hooked = [], {}, set()

    def _closes_window(self, p: torch.Tensor) -> bool:
        if self.accumulation_steps is not None:
            n = self._counts[p] = self._counts.get(p, 0) + 1
            return n >= self.accumulation_steps
        sync = accelerate_flag("sync_gradients")
        return True if sync is None else bool(sync)

    def _hook(self, p: torch.Tensor) -> None:
        if not self._closes_window(p) or not self.enabled:
            return
        with self._lock:
            if self._plan is None:
                self._plan = self.plan_window()
            if self._learning:
                self._seen.append(p)
            bucket = self._bucket_of.get(p)
            if not self._plan or bucket is None or not bucket.early:
                return  # a late bucket keeps its gradient for step()
            if bucket.index in self._done:
                todo = [p]  # a new gradient after its bucket was stepped this window: step it alone
            else:
                fired = self._fired.setdefault(bucket.index, set())
                fired.add(p)
                if len(fired) < bucket.hooked:
                    return
                self._done.add(bucket.index)
                todo = None
        start = time.perf_counter()
        self.step_bucket(bucket, todo)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.hook_seconds += elapsed
            self.hook_bucket_steps += 1

    @property
    def early_params(self) -> list[torch.Tensor]:
        """The parameters the hooks may step inside backward (what a rollback snapshot must hold)."""
        return [p for b in self.buckets if b.early for p in b.params]

    def record_norms(self, params: list[torch.Tensor]) -> None:
        """Record the gradient norms of ``params`` (one ``_foreach_norm``) without stepping them."""
        params = [p for p in params if p.grad is not None]
        if params:
            for p, norm in zip(params, torch._foreach_norm([p.grad for p in params])):
                self.norms[self._order[p]] = norm

    def step_bucket(
        self, bucket: Bucket, params: list[torch.Tensor] | None = None, scale: torch.Tensor | None = None
    ) -> None:
        """Step ``params`` of ``bucket`` (default: all) that hold a gradient with one inner call, record
        their gradient norms when needed (one ``_foreach_norm``), and free the gradients. ``scale`` (a
        device tensor) multiplies the gradients first instead of ``grad_scale``, norms unrecorded."""
        params = [p for p in (bucket.params if params is None else params) if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        stream = self.stream_for(params[0].device) if bucket.side else None
        if stream is not None:
            current = torch.cuda.current_stream(params[0].device)
            stream.wait_stream(current)
            with self._lock:
                self._pending.add(params[0].device)
                self._in_flight += 1
                full = self.max_in_flight is not None and self._in_flight > self.max_in_flight
                if full:
                    self._in_flight = 1
            if full:  # the backward stream catches up with all but this step
                current.wait_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if scale is not None:  # a late bucket after verification: the true clip coefficient
                torch._foreach_mul_(grads, scale)
            else:
                if self.need_norms:
                    norms = torch._foreach_norm(grads)
                    for p, norm in zip(params, norms):
                        self.norms[self._order[p]] = norm
                if self.grad_scale != 1.0:  # the predicted clip coefficient (clip_prediction="scale")
                    torch._foreach_mul_(grads, self.grad_scale)
            bucket.stepper.step(params)
        for p in params:
            if stream is not None:
                p.grad.record_stream(stream)
            p.grad = None
        with self._lock:
            self.stepped.update(params)
            self.bucket_steps += 1

    def stream_for(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` (created once), or None off CUDA."""
        if device.type != "cuda":
            return None
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def join(self) -> None:
        """Make each device's current stream wait for the bucket steps queued on its side stream."""
        with self._lock:
            pending, self._pending = self._pending, set()
            self._in_flight = 0
        for device in pending:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])

    def step_param(self, p: torch.Tensor) -> None:
        """Step ``p`` alone with the inner optimizer and free its gradient."""
        self.step_bucket(self._bucket_of[p], [p])

    def leftovers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Parameters that still hold a gradient this window (their hook did not fire on the closing
        step, or their bucket did not complete)."""
        return [p for p in params if p.grad is not None and p not in self.stepped]

    def step_leftovers(self, params: list[torch.Tensor], scale: torch.Tensor | None = None) -> None:
        """Step the :meth:`leftovers` of ``params``, one inner call per bucket (run from ``step()``);
        ``scale``: see :meth:`step_bucket`."""
        todo = self.leftovers(params)
        if any(p not in self._bucket_of for p in todo):  # param groups changed behind the pipeline's back
            self.rebuild(self._inner)
        by_bucket: dict[int, list[torch.Tensor]] = {}
        for p in todo:
            by_bucket.setdefault(self._bucket_of[p].index, []).append(p)
        for index, todo in by_bucket.items():
            self.step_bucket(self.buckets[index], todo, scale)

    def ordered_norms(self) -> list[torch.Tensor]:
        return [self.norms[i] for i in sorted(self.norms)]

    def window_norm(self, params: list[torch.Tensor], record: bool) -> torch.Tensor | None:
        """The closing window's global gradient norm (a device tensor; None without gradients): the
        norms the hooks recorded and, when ``record``, those of the :meth:`leftovers` of ``params``."""
        self.join()
        if record:
            self.record_norms(self.leftovers(params))
        norms = self.ordered_norms()
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else None

    def stats(self) -> dict[str, float | int]:
        """Hook time and bucket counts, for the optimizer's ``stats()``."""
        return {
            "hook_seconds": self.hook_seconds,
            "pipeline_buckets": len(self.buckets),
            "early_buckets": sum(b.early for b in self.buckets),
            "hook_bucket_steps": self.hook_bucket_steps,
            "bucket_steps": self.bucket_steps,
        }

    def reset_window(self) -> None:
        self.grad_scale = 1.0
        self._counts.clear()
        self._plan = None
        self.stepped.clear()
        self.norms.clear()
        self._fired.clear()
        self._done.clear()
        if self._learning and self._seen:
            # the first closing window showed the order gradients really complete in: cut by it
            self._learned = list(dict.fromkeys(self._seen))
            self._learning, self._seen = False, []
            if self._inner is not None:
                self.rebuild(self._inner)


def _weak_hook(pipeline: GradientPipeline) -> Callable[[torch.Tensor], None]:
    """The parameter hook, holding the pipeline weakly.

    A hook kept on a parameter lives on the C++ side, where Python's garbage collector cannot see it, so
    a bound method there (parameter -> hook -> pipeline -> optimizer -> parameter) kept every optimizer,
    its state and the parameters alive after the user dropped them (seen as GPU memory growing from one
    optimizer to the next in benchmarks/optimizer). Once the optimizer is gone the hook does nothing.
    """
    ref = weakref.ref(pipeline)

    def hook(p: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target._hook(p)

    return hook
