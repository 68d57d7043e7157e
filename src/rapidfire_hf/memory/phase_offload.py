"""Host offload between the phases of a PPO update: frozen models' weights and the optimizer state.

A PPO update reads the frozen models (the reference and the reward model) only while scoring, and the
optimizer state only while training. :class:`FrozenWeights` keeps the frozen models' weights in pinned host
memory outside scoring; :class:`PhaseOffload` moves them and the optimizer state
(:class:`~rapidfire_hf.memory.offload.OptimizerStateOffload`) at the phase boundaries:

========================  ===============================  ==================================
boundary                  frozen weights                   optimizer state
========================  ===============================  ==================================
before generation         freed (host copy kept)           copied to the host, freed
before scoring            copied in on a side stream       away
after scoring             freed (no copy: they are frozen) away
before training           away                             copied in on a side stream
before the optimizer step away                             waited for (no host sync)
========================  ===============================  ==================================

Frozen weights are copied to the host once: they do not change, so freeing them later costs no copy (a
weight whose tensor version moved since its copy, an in-place write, is copied again). Every move keeps
the same ``Parameter`` objects: each storage is resized to 0 bytes and back, so the models, their fused
paths and any module that holds a weight see the same tensors, only the memory is away in between.
The arithmetic is unchanged: the bytes that come back are the bytes that left.

On CUDA the copies in run on a side stream and each model waits only for its own weights
(:meth:`FrozenWeights.wait`), so the reward model's copy runs beside the reference's forward. Elsewhere
nothing moves unless ``include_cpu`` (tests): then CPU storages go to a separate host buffer and back.
"""

from __future__ import annotations

import torch

from rapidfire_hf.memory.offload import OptimizerStateOffload


class _Storage:
    """One parameter storage of a frozen model and its host copy."""

    __slots__ = ("storage", "nbytes", "host", "params", "versions", "resizable")

    def __init__(self, storage: torch.UntypedStorage, params: list[torch.Tensor]):
        self.storage, self.nbytes, self.params = storage, storage.nbytes(), params
        self.host: torch.UntypedStorage | None = None
        self.versions: tuple[int, ...] = ()
        self.resizable = True  # False once a resize failed: the storage stays on the device

    def changed(self) -> bool:
        return self.versions != tuple(p._version for p in self.params)


class FrozenWeights:
    """The weights of frozen models, moved to pinned host memory and back (module docstring).

    Args:
        models: name -> a module the run never trains (e.g. ``{"reference": ref, "reward": rm}``; a reward
            model's parameters may still say ``requires_grad``: no optimizer holds them). A weight written
            in place anyway is copied to the host again at the next offload (its tensor version moved).
        include_cpu: also move weights that live on the CPU (to another host buffer: for tests only).
    """

    def __init__(self, models: dict[str, torch.nn.Module], include_cpu: bool = False):
        self.include_cpu = include_cpu
        self._models: dict[str, list[_Storage]] = {}
        self._events: dict[str, object] = {}
        self._stream = None
        self.away = False
        self.copies_out = 0  # device -> host copies made (frozen: once per storage, unless written to)
        self.copies_in = 0  # host -> device copies (one per storage per restore)
        self.skipped = 0  # storages left on the device because they cannot be resized
        seen: set[int] = set()
        for name, model in models.items():
            by_storage: dict[int, tuple[torch.UntypedStorage, list]] = {}
            for p in model.parameters():
                if p.device.type == "meta" or (p.device.type == "cpu" and not include_cpu):
                    continue
                st = p.untyped_storage()
                if st.nbytes() == 0 or st.data_ptr() in seen and st.data_ptr() not in by_storage:
                    continue  # empty, or shared with a model listed before (moved once, there)
                by_storage.setdefault(st.data_ptr(), (st, []))[1].append(p)
            seen.update(by_storage)
            self._models[name] = [_Storage(st, ps) for st, ps in by_storage.values()]

    def nbytes(self, name: str | None = None) -> int:
        """Device bytes of the weights moved (of model ``name``, or of all)."""
        names = [name] if name is not None else list(self._models)
        return sum(s.nbytes for n in names for s in self._models[n])

    def _all(self):
        return [s for storages in self._models.values() for s in storages]

    def offload(self) -> int:
        """Free the weights' device memory (copying a storage to the host the first time, or when it was
        written to since); returns the bytes freed. A no-op while they are away."""
        if self.away:
            return 0
        self.wait_all()
        freed = 0
        for s in self._all():
            if not s.resizable:
                continue
            if s.host is None or s.changed():
                if s.host is None:
                    pinned = s.storage.device.type == "cuda"
                    s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
                s.host.copy_(s.storage)  # synchronous: the device block is freed right after
                s.versions = tuple(p._version for p in s.params)
                self.copies_out += 1
            try:
                s.storage.resize_(0)
            except RuntimeError:  # a storage that cannot be resized (e.g. memory-mapped) stays
                s.resizable, s.host = False, None
                self.skipped += 1
                continue
            freed += s.nbytes
        self.away = True
        return freed

    def restore(self) -> None:
        """Allocate the weights again (same tensor objects) and copy them in: on CUDA on a side stream, one
        event per model (:meth:`wait`); elsewhere at once. A no-op while they are on the device."""
        if not self.away:
            return
        self.away = False
        for name, storages in self._models.items():
            storages = [s for s in storages if s.resizable]
            cuda = [s for s in storages if s.storage.device.type == "cuda"]
            for s in storages:
                s.storage.resize_(s.nbytes)  # allocated in the current stream
                if s.storage.device.type != "cuda":
                    s.storage.copy_(s.host)
                self.copies_in += 1
            if not cuda:
                continue
            device = cuda[0].storage.device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            # the new blocks may still be in use by kernels queued before on the current stream
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for s in cuda:
                    s.storage.copy_(s.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[name] = (device, event)

    def wait(self, name: str) -> None:
        """Make the current stream wait for model ``name``'s weights (no host sync; a no-op when they are
        already there)."""
        pending = self._events.pop(name, None)
        if pending is not None:
            device, event = pending
            torch.cuda.current_stream(device).wait_event(event)

    def wait_all(self) -> None:
        """Make the current stream wait for every model's weights."""
        for name in list(self._events):
            self.wait(name)


class PhaseOffload:
    """What a PPO update moves to the host between its phases (module docstring's table).

    Args:
        frozen: the frozen models' weights, or None (not offloaded).
        state: the policy's optimizer state, or None (not offloaded).
    """

    def __init__(self, frozen: FrozenWeights | None = None, state: OptimizerStateOffload | None = None):
        self.frozen = frozen
        self.state = state
        self._state_away = False

    @classmethod
    def build(cls, frozen_models: dict, optimizer, include_cpu: bool = False) -> PhaseOffload:
        """``frozen_models`` (name -> module; empty: none) and ``optimizer`` (None: its state stays)."""
        frozen = FrozenWeights(frozen_models, include_cpu=include_cpu) if frozen_models else None
        state = OptimizerStateOffload(optimizer, include_cpu=include_cpu) if optimizer is not None else None
        return cls(frozen, state)

    @property
    def active(self) -> bool:
        return self.frozen is not None or self.state is not None

    def before_generation(self) -> None:
        """Frozen weights and optimizer state away (neither is read by the rollout)."""
        freed = self.frozen.offload() if self.frozen is not None else 0
        if self.state is not None and not self._state_away:
            freed += self.state.offload()
            self._state_away = True
        if freed and torch.cuda.is_available() and torch.cuda.is_initialized():
            # the freed blocks back to the driver: the KV cache's large blocks need not fit between them
            torch.cuda.empty_cache()

    def before_scoring(self) -> None:
        """Frozen weights copied in (each model waits for its own with :meth:`ready`)."""
        if self.frozen is not None:
            self.frozen.restore()

    def ready(self, name: str) -> None:
        """Before model ``name`` (``"reference"``, ``"reward"``) runs."""
        if self.frozen is not None:
            self.frozen.wait(name)

    def after_scoring(self) -> None:
        """Frozen weights freed again (their host copy is current: no copy)."""
        if self.frozen is not None:
            self.frozen.offload()

    def before_training(self) -> None:
        """The optimizer state copied in on a side stream (:meth:`before_step` waits for it)."""
        if self.state is not None and self._state_away:
            self.state.restore()
            self._state_away = False

    def before_step(self) -> None:
        """Before the step that reads the optimizer state (no host sync)."""
        if self.state is not None:
            self.state.wait()

    def close(self) -> None:
        """Everything back on the device (the end of ``train()``: evaluation, saving and user code after
        it see every weight and the whole optimizer state)."""
        if self.frozen is not None:
            self.frozen.restore()
            self.frozen.wait_all()
        self.before_training()
        self.before_step()
