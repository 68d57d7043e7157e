"""Peak memory and time per phase of a GRPO training step, and tokens/s over all steps and the steady state."""

from __future__ import annotations

from rapidfire_hf.utils.units import GIB


class PhaseMemory:
    """Peak allocated (and reserved) GPU memory, and time, per phase of the training step.

    Phases: ``generation`` (``_generate_and_score_completions``: rollout, rewards, advantages),
    ``loss_forward`` (``compute_loss``), ``backward`` (``accelerator.backward``; with the gradient
    pipeline this includes the optimizer's bucket steps), ``grad_clip`` (``accelerator.clip_grad_norm_``),
    ``optimizer_step`` (between the Trainer's ``on_pre_optimizer_step`` and ``on_optimizer_step``), and
    ``other`` (everything in between). At each boundary the peak since the last boundary is read
    (``torch.cuda.max_memory_allocated``) and charged to the phase that was running, then the peak is
    reset (``reset_peak_memory_stats``), so the largest phase peak is the process's peak. Side effect:
    anything else reading ``max_memory_allocated`` (``rapidfire/memory/max_allocated_gib``) sees the peak
    since the last boundary only.

    Time: at each boundary the host clock is read (``cpu_s``: host seconds spent in each phase, which
    for asynchronous CUDA work is the time to enqueue it, plus any syncs) and, on CUDA, an event is
    recorded on the current stream (``gpu_s``: the current stream's time between the boundaries, kernels
    plus idle gaps, so the phases add up to the step as the device saw it). No sync is added: the events
    are read at the end of each step, after the step timer's ``synchronize``. On the CPU, memory is not
    measured and ``gpu_s`` is empty.
    """

    PHASES = ("generation", "loss_forward", "backward", "grad_clip", "optimizer_step", "other")

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.current = "other"
        self.stack: list[str] = []
        self.peak = dict.fromkeys(self.PHASES, 0)
        self.reserved = dict.fromkeys(self.PHASES, 0)
        self.at_start = dict.fromkeys(self.PHASES, 0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self.step_peak: dict[str, int] = {}
        self.per_step: list[dict[str, float]] = []
        self.t_last = None  # host clock at the last boundary
        self.ev_last = None  # CUDA event at the last boundary
        self.step_cpu: dict[str, float] = {}
        self.step_events: list[tuple] = []  # (phase, start event, end event) of this step
        self.per_step_time: list[dict] = []

    def _close(self) -> None:
        import time as _time

        now = _time.perf_counter()
        if self.t_last is not None:
            self.step_cpu[self.current] = self.step_cpu.get(self.current, 0.0) + now - self.t_last
        self.t_last = now
        if not self.cuda:
            return
        cuda = self.torch.cuda
        event = cuda.Event(enable_timing=True)
        event.record()
        if self.ev_last is not None:
            self.step_events.append((self.current, self.ev_last, event))
        self.ev_last = event
        peak, reserved = cuda.max_memory_allocated(), cuda.max_memory_reserved()
        name = self.current
        self.peak[name] = max(self.peak[name], peak)
        self.reserved[name] = max(self.reserved[name], reserved)
        self.step_peak[name] = max(self.step_peak.get(name, 0), peak)
        cuda.reset_peak_memory_stats()

    def enter(self, name: str) -> None:
        self._close()
        self.stack.append(self.current)
        self.current = name
        self.calls[name] += 1
        if self.cuda:
            self.at_start[name] = max(self.at_start[name], self.torch.cuda.memory_allocated())

    def exit(self) -> None:
        self._close()
        self.current = self.stack.pop() if self.stack else "other"

    def end_step(self) -> None:
        self._close()
        gpu: dict[str, float] = {}
        if self.cuda:
            self.per_step.append({k: v / GIB for k, v in self.step_peak.items()})
            self.ev_last.synchronize()
            for name, start, end in self.step_events:
                gpu[name] = gpu.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        self.per_step_time.append({"cpu_s": self.step_cpu, "gpu_s": gpu})
        self.step_peak, self.step_cpu, self.step_events = {}, {}, []

    def start(self) -> None:
        """Mark the start of training (the first boundary of the time accounting)."""
        self._close()

    def wrap(self, owner, attr: str, phase: str) -> None:
        import functools

        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            self.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, attr, wrapped)

    def install(self, trainer) -> None:
        from transformers import TrainerCallback

        self.wrap(trainer, "_generate_and_score_completions", "generation")
        self.wrap(trainer, "compute_loss", "loss_forward")
        self.wrap(trainer.accelerator, "backward", "backward")
        self.wrap(trainer.accelerator, "clip_grad_norm_", "grad_clip")
        phases = self

        class Boundaries(TrainerCallback):
            def on_pre_optimizer_step(self, *a, **k):
                phases.enter("optimizer_step")

            def on_optimizer_step(self, *a, **k):
                phases.exit()

            def on_step_end(self, *a, **k):
                phases.end_step()

        trainer.add_callback(Boundaries())

    def overall_peak(self) -> tuple[int, int] | None:
        """(allocated, reserved) peak bytes over all phases (what one unreset reading would give)."""
        if not self.cuda:
            return None
        self._close()
        return max(self.peak.values()), max(self.reserved.values())

    def time_report(self) -> dict:
        """Seconds per phase: per step, and the median over steps 2.. (steady state) of each phase."""
        import statistics

        steady = self.per_step_time[1:]

        def median(kind: str) -> dict[str, float]:
            names = dict.fromkeys(k for step in steady for k in step[kind])
            return {k: statistics.median(step[kind].get(k, 0.0) for step in steady) for k in names}

        return {
            "per_step": self.per_step_time,
            "median_steps_2_on": {"cpu_s": median("cpu_s"), "gpu_s": median("gpu_s")} if steady else None,
            "note": "cpu_s: host seconds in each phase (enqueueing asynchronous work, plus syncs); gpu_s: "
            "the current CUDA stream's time between the phase boundaries (kernels plus idle gaps; sums to "
            "about the step). 'other' includes the dataloader, logging, zero_grad, the scheduler and the "
            "time between steps (its first step also the time before the first boundary).",
        }

    def report(self) -> dict:
        gib = (lambda d: {k: v / GIB for k, v in d.items()}) if self.cuda else (lambda d: None)
        return {
            "peak_allocated_gib": gib(self.peak),
            "peak_reserved_gib": gib(self.reserved),
            "allocated_at_phase_start_gib": gib(self.at_start),
            "peak_allocated_gib_per_step": self.per_step if self.cuda else None,
            "calls": dict(self.calls),
            "note": "peak charged to the phase running when it happened; backward includes the gradient "
            "pipeline's bucket steps; other = dataloader, logging, zero_grad, scheduler",
        }


def speed(step_s: list[float], step_tokens: list[int]) -> dict:
    """Tokens/s over all steps and over steps 2.. (steady state), and the first step's one-time cost."""
    import statistics

    n = len(step_s)
    out = {
        "all_steps": {
            "steps": n,
            "tokens": sum(step_tokens),
            "seconds": sum(step_s),
            "tokens_per_sec": sum(step_tokens) / max(sum(step_s), 1e-9),
        },
        "steady_state_steps_2_on": None,
        "first_step_s": step_s[0] if step_s else None,
        "median_step_s_steps_2_on": None,
        "first_step_excess_s": None,
    }
    if n > 1:
        rest = step_s[1:]
        median = statistics.median(rest)
        out["steady_state_steps_2_on"] = {
            "steps": n - 1,
            "tokens": sum(step_tokens[1:]),
            "seconds": sum(rest),
            "tokens_per_sec": sum(step_tokens[1:]) / max(sum(rest), 1e-9),
        }
        out["median_step_s_steps_2_on"] = median
        out["first_step_excess_s"] = step_s[0] - median  # compile, graph capture, warm-up: paid once
    return out
