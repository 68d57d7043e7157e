"""Low-memory RL training: ``memory.lowmem`` of ``enable_rapidfire`` and the mechanisms behind it.

``enable_rapidfire(trainer, config={"memory": {"lowmem": "on"}})`` on a TRL ``GRPOTrainer`` or
``RLOOTrainer`` applies everything below (``install_lowmem``); the functions are public for use on
their own. Measured with ``benchmarks/grpo/run.py`` (variant ``rapidfire_lowmem4``, H200, 1.1B Llama,
batch 64 x 384 tokens): 3.88x stock TRL 1.16's steady-state tokens/s at 0.496x its peak allocated memory.

Chunked, host-offloaded activation checkpointing of decoder layers (``apply_chunked_checkpointing``).

Why: with full checkpointing (TRL's ``gradient_checkpointing=True``, or rapidfire_hf's
``apply_selective_checkpointing(model, "aggressive")``), a GRPO step on the 1.1B Llama shape at 64
sequences x 384 tokens keeps every decoder layer's input on the GPU until backward (22 x 64 x 384 x
2048 x 2 bytes = 2.06 GiB) and recomputes one whole layer for all 24576 tokens at once in backward
(~2-2.5 GiB of saved activations plus their gradients, the MLP's 5632-wide intermediates dominating).
Together they are about half of the step's peak (see benchmarks/grpo/README.md, "Where the peak comes
from").

What this does, per wrapped module (each decoder layer, and the final norm):

- forward: runs the module under ``no_grad`` in chunks of ``rows`` sequences (rows of the batch are
  independent in a decoder layer: attention never mixes sequences), and keeps only its input, in
  pinned host memory (copied on a side stream, next to the compute) or on the device (``offload=False``).
- backward: brings the input back a chunk at a time (each chunk copied on the side stream while the
  chunk before it runs), recomputes the module on that chunk with autograd on, and backpropagates it
  with ``torch.autograd.grad``; the input gradient is written per chunk, the parameter gradients are
  summed over the chunks (in fp32 for bf16/fp16 gradients, rounded once at the end) and returned
  once. Parameters are inputs of the autograd function, so each parameter's ``.grad`` is
  written exactly once per backward and ``register_post_accumulate_grad_hook`` (RapidFireOptimizer's
  gradient pipeline) fires once per parameter, as with plain autograd.

The arithmetic of each chunk is the module's own forward and backward on fewer rows; the only
difference to unchunked backward is in the parameter gradients: each chunk's weight-gradient GEMM
rounds its partial sum to the gradient dtype (in bf16 that is one bf16 rounding per chunk, about what
gradient accumulation over that many micro-batches costs; the partials are then added in fp32), and in
fp32 the summation order. ``tests/integrations/test_grpo_lowmem.py`` checks TRL's GRPO loss and every
gradient against no checkpointing at all (fp32, CPU; on CUDA too when a GPU is present).

Limits: no RNG state is replayed in the recompute (fine for Llama, whose attention dropout is 0 and
TRL disables dropout); keyword tensors whose first dimension equals the batch (attention masks,
per-row position ids) are sliced per chunk, others are passed whole; the module must return a tensor
(or a tuple whose first element is the tensor and whose other elements are not tensors).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

GIB = 2.0**30


@dataclass
class OffloadStats:
    """What the offloader moved (bytes per direction, summed over the run)."""

    to_host_bytes: int = 0
    to_device_bytes: int = 0
    saved: int = 0
    prefetched: int = 0
    host_buffers_created: int = 0  # host buffers allocated (pinned on CUDA)
    host_buffers_reused: int = 0  # saves served from the offloader's own pool (``reuse_host_buffers``)

    def as_dict(self) -> dict:
        return {
            "to_host_gib": self.to_host_bytes / GIB,
            "to_device_gib": self.to_device_bytes / GIB,
            "tensors_saved": self.saved,
            "prefetched": self.prefetched,
            "host_buffers_created": self.host_buffers_created,
            "host_buffers_reused": self.host_buffers_reused,
        }


class _Saved:
    """One saved module input (on the host when offloaded, else the device tensor itself), in chunks."""

    __slots__ = ("host", "device_tensor", "device", "shape", "dtype", "chunks", "fetched", "prev", "done")
    __slots__ += ("give_back", "__weakref__")

    def __init__(self, t: torch.Tensor, chunks: list[slice]):
        self.host = self.device_tensor = self.prev = self.give_back = None
        self.device, self.shape, self.dtype, self.chunks = t.device, t.shape, t.dtype, chunks
        self.fetched: dict[int, tuple] = {}  # chunk index -> (device tensor, event) copied ahead
        self.done = False  # every chunk was handed to backward: nothing left to fetch


@dataclass
class HostOffloader:
    """Moves checkpointed module inputs to pinned host memory in forward and back, chunk by chunk, in backward.

    On CUDA the copies run on one side stream: device -> host next to the module's own forward, and
    host -> device one chunk ahead of backward: while backward works on a chunk, the next chunk it
    will need (of the same module, or the first chunk of the module that backward reaches next) is
    copied in. Only two chunks of an offloaded input are ever on the device. Elsewhere (CPU) nothing
    is copied: the input is kept as it is. On the ``meta`` device (memory models) only the shape is
    kept and chunks come back as fresh tensors, as if offloaded.

    Host buffers: by default each save takes a new pinned tensor from torch's caching host allocator and
    drops it after its backward. ``reuse_host_buffers=True`` keeps them in the offloader's own pool instead
    (a buffer goes back to the pool when backward has loaded its last chunk, or when the saved input dies
    without a backward), so from the second step on no pinned memory is allocated. Why it matters
    (``rapidfire_lowmem4``): every CUDA-graph capture (``torch.cuda.graph``, which the rollout engine enters
    once per rollout when it is released after each) calls ``torch._C._host_emptyCache()``, so the
    allocator's cached pinned blocks are returned to the driver before every training step and the next
    forward pins ~2.9 GB again (cudaHostAlloc, page by page). Buffers held by the pool are in use, so the
    capture does not free them. Reuse is safe without any event: the buffer is written (device -> host)
    and read (host -> device) only on the one side stream, so a new save's copy runs after every read of
    the buffer's previous use in stream order; the host never touches the bytes.

    Args:
        enabled: offload at all (False: keep inputs on the device, like plain checkpointing).
        reuse_host_buffers: keep the host buffers in a pool across steps (see above).
        copy_on_cpu: tests only: CPU inputs are copied to separate (unpinned) host buffers and back as if
            offloaded (no streams), so the buffer handling runs on a machine without a GPU.
    """

    enabled: bool = True
    reuse_host_buffers: bool = False
    copy_on_cpu: bool = False
    stats: OffloadStats = field(default_factory=OffloadStats)
    _stream: object = None
    _last: weakref.ref | None = None
    _pool: dict = field(default_factory=dict)  # (shape, dtype) -> free host buffers

    def _copy_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pooled_bytes(self) -> int:
        """Bytes of host buffers waiting in the pool (``reuse_host_buffers``)."""
        return sum(b.numel() * b.element_size() for bufs in self._pool.values() for b in bufs)

    def _host_buffer(self, s: _Saved) -> torch.Tensor:
        key = (tuple(s.shape), s.dtype)
        free = self._pool.get(key) if self.reuse_host_buffers else None
        if free:
            host = free.pop()
            self.stats.host_buffers_reused += 1
        else:
            host = torch.empty(s.shape, dtype=s.dtype, pin_memory=s.device.type == "cuda")
            self.stats.host_buffers_created += 1
        if self.reuse_host_buffers:
            # back to the pool after backward's last chunk, or when the saved input dies unused
            s.give_back = weakref.finalize(s, self._pool.setdefault(key, []).append, host)
            s.give_back.atexit = False
        return host

    def save(self, t: torch.Tensor, chunks: list[slice]) -> _Saved:
        """Keep ``t`` (the input of a module call) for backward, which will read it in ``chunks``."""
        s = _Saved(t, chunks)
        self.stats.saved += 1
        if not self.enabled or (t.device.type == "cpu" and not self.copy_on_cpu):
            s.device_tensor = t.detach()
        elif t.device.type == "meta":
            pass  # a memory model: nothing to copy, the device bytes are gone as if offloaded
        elif t.device.type == "cpu":
            s.host = self._host_buffer(s)
            s.host.copy_(t.detach())
            self.stats.to_host_bytes += t.numel() * t.element_size()
        else:
            stream = self._copy_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete before it is read
            s.host = self._host_buffer(s)
            with torch.cuda.stream(stream):
                s.host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)  # its block is not reused before the copy has read it
            self.stats.to_host_bytes += t.numel() * t.element_size()
        # backward visits modules in reverse: each saved input knows the one saved before it, weakly
        # (a forward whose backward never runs does not keep its inputs alive)
        last = self._last() if self._last is not None else None
        s.prev = weakref.ref(last) if last is not None and not last.done else None
        self._last = weakref.ref(s)
        return s

    def _fetch(self, s: _Saved, i: int) -> None:
        """Start the host -> device copy of chunk ``i`` of ``s`` on the side stream (no wait)."""
        if s.done or i in s.fetched or s.device_tensor is not None:
            return
        sl = s.chunks[i]
        shape = (sl.stop - sl.start, *s.shape[1:])
        if s.device.type == "meta":
            s.fetched[i] = (torch.empty(shape, dtype=s.dtype, device=s.device), None)
            return
        if s.device.type == "cpu":  # copy_on_cpu (tests)
            s.fetched[i] = (s.host[sl].clone(), None)
            self.stats.to_device_bytes += s.fetched[i][0].numel() * s.fetched[i][0].element_size()
            return
        stream = self._copy_stream(s.device)
        dev = torch.empty(shape, dtype=s.dtype, device=s.device)  # allocated in the compute stream
        stream.wait_stream(torch.cuda.current_stream(s.device))  # its block may still be in use there
        with torch.cuda.stream(stream):
            dev.copy_(s.host[sl], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        s.fetched[i] = (dev, event)
        self.stats.to_device_bytes += dev.numel() * dev.element_size()

    def load(self, s: _Saved, i: int) -> torch.Tensor:
        """Chunk ``i`` of the saved input on its device; starts copying the chunk backward needs next."""
        if s.device_tensor is not None:
            t = s.device_tensor[s.chunks[i]]
        else:
            self._fetch(s, i)
            t, event = s.fetched.pop(i)
            if event is not None:
                torch.cuda.current_stream(s.device).wait_event(event)
        last = i == len(s.chunks) - 1
        following = (s, i + 1) if not last else ((s.prev() if s.prev is not None else None), 0)
        if following[0] is not None and following[0].device_tensor is None and not following[0].done:
            self._fetch(*following)
            self.stats.prefetched += 1
        if last:
            if s.give_back is not None:
                s.give_back()  # the buffer's reads are queued on the side stream: its next write is too
            s.host = s.device_tensor = s.prev = s.give_back = None  # drop every reference
            s.fetched.clear()
            s.done = True
        return t


def _split_kwargs(kwargs: dict, batch: int, rows: slice) -> dict:
    """``kwargs`` with every tensor whose first dimension is the batch sliced to ``rows``."""

    def cut(v):
        if isinstance(v, torch.Tensor) and batch > 1 and v.dim() >= 2 and v.shape[0] == batch:
            return v[rows]
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        return v

    return {k: cut(v) for k, v in kwargs.items()}


def _first(out):
    """The output tensor of a module call, and the rest of its return value (``None``: a bare tensor)."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        if any(isinstance(x, torch.Tensor) for x in out[1:]):
            raise TypeError("chunked checkpointing: the module returned more than one tensor")
        return out[0], out[1:]
    raise TypeError(f"chunked checkpointing: unsupported module output {type(out).__name__}")


class _ChunkedCheckpoint(torch.autograd.Function):
    """``run(hidden, **kwargs)`` with its input saved by ``offloader`` and backward recomputed by chunks.

    The module's parameters are inputs (``*params``), so their gradients are outputs of this function.
    """

    @staticmethod
    def forward(ctx, hidden, run, kwargs, rows, offloader, *params):
        batch = hidden.shape[0]
        rows, forward_rows = rows if isinstance(rows, tuple) else (rows, rows)
        chunks = [slice(i, min(i + rows, batch)) for i in range(0, batch, rows)]
        ctx.saved = offloader.save(hidden, chunks)  # first: the copy to the host runs next to the compute
        out = None
        # forward runs under no_grad (nothing is saved), so it may use wider chunks than backward
        forward_chunks = [slice(i, min(i + forward_rows, batch)) for i in range(0, batch, forward_rows)]
        for sl in forward_chunks:
            y = _first(run(hidden[sl], **_split_kwargs(kwargs, batch, sl)))[0]
            if len(forward_chunks) == 1:
                out = y
            else:
                if out is None:
                    out = y.new_empty((batch, *y.shape[1:]))
                out[sl] = y
            del y
        ctx.run, ctx.kwargs, ctx.chunks, ctx.offloader = run, kwargs, chunks, offloader
        ctx.batch, ctx.params = batch, params
        ctx.autocast = _autocast_state(hidden.device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        need_hidden = ctx.needs_input_grad[0]
        need = ctx.needs_input_grad[5:]
        want = [p for p, n in zip(ctx.params, need) if n]
        grad_hidden = None
        sums: list[torch.Tensor | None] = [None] * len(want)
        for i, sl in enumerate(ctx.chunks):
            h = ctx.offloader.load(ctx.saved, i).detach().requires_grad_(need_hidden)
            with torch.enable_grad(), _autocast(ctx.autocast):
                y = _first(ctx.run(h, **_split_kwargs(ctx.kwargs, ctx.batch, sl)))[0]
            grads = torch.autograd.grad(
                y, ([h] if need_hidden else []) + want, grad_out[sl], allow_unused=True
            )
            del y, h
            if need_hidden:
                if grad_hidden is None:
                    grad_hidden = grads[0].new_empty((ctx.batch, *grads[0].shape[1:]))
                grad_hidden[sl] = grads[0]
                grads = grads[1:]
            for j, g in enumerate(grads):
                if g is None:
                    continue
                if sums[j] is None:
                    # more than one chunk of a bf16/fp16 gradient: sum in fp32, round once at the end
                    wide = len(ctx.chunks) > 1 and g.dtype in (torch.bfloat16, torch.float16)
                    sums[j] = g.float() if wide else g
                else:
                    sums[j].add_(g)
            del grads
        ctx.run = ctx.kwargs = ctx.saved = None
        it = iter(sums)
        param_grads = []
        for p, n in zip(ctx.params, need):
            g = next(it) if n else None
            param_grads.append(g.to(p.dtype) if g is not None and g.dtype != p.dtype else g)
        ctx.params = None
        return (grad_hidden, None, None, None, None, *param_grads)


def _autocast_state(device: torch.device) -> tuple:
    kind = "cuda" if device.type == "cuda" else "cpu"
    return (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))


def _autocast(state: tuple):
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype) if enabled else contextlib.nullcontext()


class _Runner:
    """Calls a module's original forward (the autograd context holds this, not the wrapper) and
    remembers the non-tensor rest of its return value, so the wrapper returns the same structure."""

    __slots__ = ("fn", "rest")

    def __init__(self, fn):
        self.fn = fn
        self.rest = None

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.rest = _first(out)[1]
        return out


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _wrap(module: torch.nn.Module, rows: int | tuple[int, int], offloader: HostOffloader) -> None:
    original = module.forward
    run = _Runner(original)

    @functools.wraps(original)
    def forward(hidden_states, *args, **kwargs):
        if args or not (torch.is_grad_enabled() and module.training and hidden_states.dim() >= 2):
            return original(hidden_states, *args, **kwargs)  # generation, eval, or an unknown call form
        params = [p for p in module.parameters() if p.requires_grad]
        if not params and not hidden_states.requires_grad:
            return original(hidden_states, **kwargs)
        # as HF's own checkpointing does: no KV cache while training (the recompute would write it again)
        kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        out = _ChunkedCheckpoint.apply(hidden_states, run, kwargs, rows, offloader, *params)
        return out if run.rest is None else (out, *run.rest)  # e.g. (hidden, None) from older layers

    module.forward = forward
    module._rapidfire_chunked_checkpoint = (rows, offloader)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.model.layers``; PEFT through its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, base.base_model_prefix, None) if hasattr(base, "base_model_prefix") else None
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"{type(base).__name__}: no decoder layers found at .{base.base_model_prefix}.layers")
    return list(layers)


def apply_chunked_checkpointing(
    model,
    rows: int = 8,
    offload: bool = True,
    include_final_norm: bool = True,
    forward_rows: int | None = None,
    reuse_host_buffers: bool = False,
    copy_on_cpu: bool = False,
) -> HostOffloader:
    """Checkpoint every decoder layer (and the final norm) of ``model`` chunk by chunk, inputs offloaded.

    Leave HF's own gradient checkpointing off (``GRPOConfig(gradient_checkpointing=False)``): this
    replaces it. Generation, evaluation and ``no_grad`` calls run the original forward untouched.

    Args:
        model: HF causal LM (Llama family: ``model.model.layers`` and ``model.model.norm``).
        rows: sequences per chunk in backward (and forward); the batch is split along its first dim.
        offload: keep the checkpointed inputs in pinned host memory (CUDA) instead of on the device.
        include_final_norm: also checkpoint the final norm (its fp32 intermediates would otherwise
            stay saved for the whole backward).
        forward_rows: sequences per chunk in the forward pass (default: ``rows``). The forward runs
            under ``no_grad`` and saves nothing, so its transient is one layer's forward on that many
            rows; wider forward chunks mean fewer (larger) kernels. Same arithmetic per row.
        reuse_host_buffers: keep the pinned host buffers in the offloader's pool across steps instead
            of allocating them every forward (``HostOffloader``; ``rapidfire_lowmem4``).
        copy_on_cpu: tests only: copy CPU inputs to host buffers and back as if offloaded.

    Returns:
        The offloader (its ``stats`` say how many bytes moved).
    """
    for name, value in (("rows", rows), ("forward_rows", forward_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: sequences per chunk, an int >= 1")
    if rows is None:
        raise ValueError("rows=None: sequences per chunk, an int >= 1")
    chunking = rows if forward_rows is None or forward_rows == rows else (rows, forward_rows)
    offloader = HostOffloader(enabled=offload, reuse_host_buffers=reuse_host_buffers, copy_on_cpu=copy_on_cpu)
    for layer in decoder_layers(model):
        if hasattr(layer, "_rapidfire_chunked_checkpoint"):
            raise RuntimeError("apply_chunked_checkpointing was already applied to this model")
        _wrap(layer, chunking, offloader)
    if include_final_norm:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        norm = getattr(getattr(base, base.base_model_prefix), "norm", None)
        if norm is not None:
            _wrap(norm, chunking, offloader)
    return offloader


class OptimizerStateOffload:
    """Moves an optimizer's state tensors to (pinned) host memory and back, keeping every tensor object.

    Each state storage is copied to the host and resized to 0 bytes, then later resized back and
    copied in: the tensors in ``optimizer.state`` stay the same Python objects (what bitsandbytes and
    RapidFireOptimizer's bucket steppers hold), only their memory is away in between. Meant for the
    rollout, when the state is not read: ``offload()`` before it, ``restore()`` after it, and
    ``wait()`` before the next optimizer step (the gradient pipeline steps during backward).

    ``offload()`` copies on the current stream, so the freed memory is reused only after the copy,
    in stream order, without a host sync. ``restore()`` on CUDA allocates in the current stream and
    copies on a side stream, so the copy runs next to whatever comes before ``wait()`` (the loss
    forward); ``wait()`` makes the current stream wait for it (again no host sync).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (or wrapper exposing ``.state``).
        include_cpu: also move state that lives on the CPU (to another host buffer: for tests only).
    """

    def __init__(self, optimizer, include_cpu: bool = False):
        self.optimizer = optimizer
        self.include_cpu = include_cpu
        self._away: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._stream = None
        self._event = None
        self._device = None
        self.offloads = 0
        self.skipped = 0  # storages left on the device because they cannot be resized
        self.bytes = 0  # of the last offload

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    st = value.untyped_storage()
                    if st.nbytes() and st.data_ptr() not in seen:
                        seen[st.data_ptr()] = st  # shared storages (e.g. bitsandbytes' qmaps) once
        return list(seen.values())

    def offload(self) -> int:
        """Copy the state to the host and free its device memory; returns the bytes moved."""
        if self._away:
            raise RuntimeError("optimizer state is already offloaded")
        self.wait()
        moved = 0
        for st in self._storages():
            if st.device.type == "cpu" and not self.include_cpu:
                continue
            n = st.nbytes()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).untyped_storage()
            host.copy_(st, non_blocking=True)
            try:
                st.resize_(0)
            except RuntimeError:  # a storage that cannot be resized (e.g. paged optimizer state) stays
                self.skipped += 1
                continue
            self._away.append((st, host))
            moved += n
        self.bytes = moved
        self.offloads += 1 if moved else 0
        return moved

    def restore(self) -> None:
        """Bring the state back (same tensor objects, new device memory); see ``wait()``."""
        away, self._away = self._away, []
        cuda = [(st, host) for st, host in away if st.device.type == "cuda"]
        for st, host in away:
            st.resize_(host.nbytes())  # allocated in the current stream
            if st.device.type != "cuda":
                st.copy_(host)
        if not cuda:
            return
        device = self._device = cuda[0][0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)  # the new blocks may still be in use by earlier kernels there
        with torch.cuda.stream(self._stream):
            for st, host in cuda:
                st.copy_(host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def wait(self) -> None:
        """Make the current stream wait for the last ``restore()``'s copies (no host sync)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None


def chunk_prefill(net, rows: int) -> None:
    """Run the static rollout engine's prompt prefill ``rows`` prompts at a time (``rapidfire_lowmem3``).

    ``net`` is the engine's ``StaticLlama`` (``RolloutEngine._static.net``). Its ``prefill`` treats rows
    independently (per-row attention mask, per-row rotary tables, cache rows written in place), so each
    chunk gets row slices of the inputs and views of the cache rows; the cache is filled exactly as by one
    call and the last positions' hidden states are concatenated. The largest transient of a rollout (one
    layer's MLP over every prompt token of the batch) shrinks ``batch / rows`` times; per row the same
    arithmetic (cuBLAS may pick another kernel for fewer rows, so bits can differ as between batch sizes).
    The decode step and its recorded graphs are untouched. Applied once per ``net`` (a second call raises).
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r}: prompts per prefill chunk, an int >= 1")
    if getattr(net, "_rapidfire_prefill_rows", None) is not None:
        raise RuntimeError("chunk_prefill was already applied to this engine")
    original = net.prefill

    @functools.wraps(original)
    def prefill(input_ids, attention_mask, cos, sin, k_cache, v_cache):
        b = input_ids.shape[0]
        if b <= rows:
            return original(input_ids, attention_mask, cos, sin, k_cache, v_cache)
        out = []
        for start in range(0, b, rows):
            sl = slice(start, min(start + rows, b))
            out.append(
                original(
                    input_ids[sl],
                    attention_mask[sl],
                    cos[sl],
                    sin[sl],
                    [k[sl] for k in k_cache],  # views: the chunk writes its rows of the cache in place
                    [v[sl] for v in v_cache],
                )
            )
        return torch.cat(out)

    net.prefill = prefill
    net._rapidfire_prefill_rows = rows


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS's per-(handle, stream) workspaces (CUDA only; False where torch has no such call).

    Why (``rapidfire_lowmem3``): the static rollout engine warms every newly recorded decode graph up on
    a fresh ``torch.cuda.Stream()``; cuBLAS allocates a workspace (32 MiB on Hopper) through the caching
    allocator for each stream it runs a GEMM on, and torch keeps it until this call. With the engine
    released after every rollout (graphs re-recorded each time) that is one more workspace per rollout,
    up to the 32 streams of torch's stream pool: it matches the ~0.031 GiB per step by which the allocated
    memory at the start of the generation phase grew in ``results/h200_lowmem2`` (and 0.28 GiB above
    weights + state after the 6 steps of ``results/h200_lowmem``). Workspaces come back on the next GEMM
    of each stream. Call only when no recorded CUDA graph uses them (after ``RolloutEngine.release()``).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    clear()
    return True


def skip_bitsandbytes_sync_on_default_stream() -> bool:
    """Make bitsandbytes' optimizers skip their per-parameter ``torch.cuda.synchronize()`` on the default stream
    (``rapidfire_lowmem4``). Returns False when bitsandbytes is not installed; applying it twice is a no-op.

    ``bitsandbytes.optim.Optimizer8bit.step`` calls ``sync_gpu(p)`` (a full device sync) after every
    parameter's update. The sync exists for paged state (unified memory the host may touch); with device
    state every kernel of the update is launched on the default stream (bitsandbytes 0.50 passes no stream
    to its 8-bit kernels), so whatever runs next on that stream is ordered after it without a host wait.
    This wrapper skips the sync only when the tensor is on CUDA and the current stream is the default
    stream; anywhere else (another current stream, e.g. a side stream of the gradient pipeline) it syncs
    as before. Do not use with paged optimizers (``is_paged=True``): their final sync goes through the same
    function. In the GRPO step the gradient pipeline steps buckets from backward hooks, where each of
    ~200 syncs drained the device queue.
    """
    try:
        import bitsandbytes.optim.optimizer as bnb_optimizer
    except ImportError:
        return False
    original = bnb_optimizer.sync_gpu
    if getattr(original, "_rapidfire_skips_default_stream", False):
        return True

    @functools.wraps(original)
    def sync_gpu(t: torch.Tensor):
        if t.device.type == "cuda" and torch.cuda.current_stream(t.device) == torch.cuda.default_stream(
            t.device
        ):
            return None
        return original(t)

    sync_gpu._rapidfire_skips_default_stream = True
    bnb_optimizer.sync_gpu = sync_gpu
    return True


def use_8bit_embedding_state(trainer) -> dict:
    """Make ``trainer`` build bitsandbytes' ``AdamW8bit`` with its own ``optim="adamw_8bit"`` arguments,
    without transformers' override that keeps ``nn.Embedding`` state in 32 bits.

    ``Trainer.create_optimizer`` registers that override only when the optimizer kwargs hold
    ``optim_bits=8``; ``AdamW8bit`` is 8-bit without the key. Param groups, lr, betas and eps stay the
    trainer's (``Trainer.get_optimizer_cls_and_kwargs`` for the same args), set as the trainer's
    ``optimizer_cls_and_kwargs``. Call before ``train()``. Changes the math against
    ``optim="adamw_8bit"`` for the embedding only: its AdamW state is 8-bit (blockwise quantised) too.

    Raises:
        ValueError: when the trainer's ``optim`` is not an 8-bit bitsandbytes AdamW.
        ImportError: when bitsandbytes is not installed.
    """
    import inspect

    from bitsandbytes.optim import AdamW8bit

    _, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    if kwargs.get("optim_bits") != 8:
        raise ValueError(f"use_8bit_embedding_state expects optim='adamw_8bit', got {trainer.args.optim!r}")
    accepted = inspect.signature(AdamW8bit.__init__).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted and k != "optim_bits"}
    trainer.optimizer_cls_and_kwargs = (AdamW8bit, kwargs)
    return {"optimizer_cls": "bitsandbytes.optim.AdamW8bit", "kwargs": repr(kwargs)}


# ---- memory.lowmem: what enable_rapidfire applies ----------------------------------------------------

# Chunk sizes of ``memory.lowmem`` (``enable_rapidfire(..., lowmem_options=...)`` overrides them): those of
# the benchmark's rapidfire_lowmem4, sized for 64 sequences x 384 tokens of a 1.1B Llama on an H200
# (benchmarks/grpo/memory_model.py). A batch of at most ``rows`` sequences is one chunk.
LOWMEM_DEFAULTS: dict[str, int] = {
    "rows": 16,  # sequences per backward (recompute) chunk of each decoder layer
    "forward_rows": 32,  # sequences per forward chunk (no_grad: saves nothing)
    "prefill_rows": 16,  # prompts per rollout prefill chunk (static engine)
    "lm_head_chunk": 4096,  # vocabulary width of TRL's fused LM-head tile (TRL's default: 32768)
}
# TrainingArguments.optim values that build a non-paged 8-bit bitsandbytes AdamW
EIGHT_BIT_OPTIMS = ("adamw_8bit", "adamw_bnb_8bit")


def lowmem_options(options: dict | None) -> dict[str, int]:
    """``LOWMEM_DEFAULTS`` updated with ``options``; unknown keys and values other than ints >= 1 raise ValueError."""
    out = dict(LOWMEM_DEFAULTS)
    for key, value in (options or {}).items():
        if key not in LOWMEM_DEFAULTS:
            raise ValueError(f"lowmem_options: unknown key {key!r}; allowed: {', '.join(LOWMEM_DEFAULTS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"lowmem_options[{key!r}]={value!r}: an int >= 1")
        out[key] = value
    return out


def _optim_name(args) -> str:
    optim = args.optim
    return str(getattr(optim, "value", optim))


def _explicit_optimizer(trainer) -> bool:
    """The user chose the optimizer object or class (``optimizers=`` / ``optimizer_cls_and_kwargs=``)."""
    return trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None


def lowmem_problems(trainer, mode: str, rollout: bool | str = True) -> list[str]:
    """Why ``memory.lowmem=mode`` cannot be applied to ``trainer`` (empty: it can).

    The option never changes the user's math on its own: the two settings that change it against stock
    TRL and that the measured memory depends on must be set in the trainer's arguments.
    """
    name = type(trainer).__name__
    if not hasattr(trainer, "_generate_single_turn"):
        return [
            f"memory.lowmem={mode!r} applies to TRL's GRPOTrainer and RLOOTrainer only (their rollout, "
            f"loss and backward); {name} is not one: set memory.lowmem to 'off'"
        ]
    problems = []
    if trainer.is_deepspeed_enabled or getattr(trainer, "is_fsdp_enabled", False):
        problems.append(
            f"memory.lowmem={mode!r} is not supported with DeepSpeed or FSDP (it was built and measured on one "
            "GPU; it wraps the decoder layers and needs RapidFireOptimizer's gradient pipeline)"
        )
    try:
        decoder_layers(trainer.model)
    except TypeError as err:
        problems.append(f"memory.lowmem={mode!r}: {err} (it checkpoints an HF causal LM's decoder layers)")
    args = trainer.args
    if args.max_grad_norm and args.max_grad_norm > 0:
        problems.append(
            f"memory.lowmem needs gradient clipping off: set max_grad_norm=0.0 in the trainer's arguments "
            f"(now {args.max_grad_norm}). With clipping, RapidFireOptimizer must hold every gradient until "
            "the norm is known in windows where clipping may bind (always the first), which costs the "
            "gradients' full size in memory. This changes the update against stock (no clipping)"
        )
    optim = _optim_name(args)
    if mode == "on_8bit_embedding":
        if _explicit_optimizer(trainer):
            problems.append(
                "memory.lowmem='on_8bit_embedding' builds the optimizer from the trainer's optim='adamw_8bit'; "
                "it cannot be combined with optimizers= or optimizer_cls_and_kwargs= (use lowmem 'on')"
            )
        elif optim not in EIGHT_BIT_OPTIMS:
            problems.append(
                f"memory.lowmem='on_8bit_embedding' needs optim='adamw_8bit' in the trainer's arguments (now "
                f"{optim!r}): 8-bit AdamW state (bitsandbytes) instead of stock's bf16/fp32 state changes the math"
            )
    elif not _explicit_optimizer(trainer) and optim not in EIGHT_BIT_OPTIMS:
        problems.append(
            f"memory.lowmem='on' needs an 8-bit optimizer: set optim='adamw_8bit' in the trainer's arguments "
            f"(now {optim!r}; 8-bit AdamW state changes the math against stock), or choose the optimizer "
            "yourself with optimizers= / optimizer_cls_and_kwargs= (then its state takes what it takes)"
        )
    return problems


@dataclass
class LowMemParts:
    """What ``install_lowmem`` applied (``trainer._rapidfire.parts["lowmem"]``).

    Attributes:
        mode: ``"on"`` or ``"on_8bit_embedding"``.
        options: the chunk sizes used (``LOWMEM_DEFAULTS`` and overrides).
        offloader: the ``HostOffloader`` of the chunked checkpointing (its ``stats``, ``pooled_bytes()``).
        applied: human-readable list of what was changed, each with whether it changes the math.
        embedding_8bit: ``use_8bit_embedding_state``'s answer (``on_8bit_embedding``), else ``None``.
        bnb_sync_skipped: whether bitsandbytes' per-parameter syncs are skipped on the default stream.
    """

    mode: str
    options: dict[str, int]
    offloader: HostOffloader
    applied: list[str] = field(default_factory=list)
    embedding_8bit: dict | None = None
    bnb_sync_skipped: bool = False

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            **self.options,
            "activation_offload": self.offloader.stats.as_dict(),
            "host_buffer_pool_gib": self.offloader.pooled_bytes() / GIB,
            "bnb_sync_skipped_on_default_stream": self.bnb_sync_skipped,
        }


def _bnb_unpaged(trainer, mode: str) -> bool:
    """The optimizer the trainer will build (or holds) is a non-paged bitsandbytes 8-bit one."""
    if trainer.optimizer is not None:
        opt = trainer.optimizer
        return type(opt).__module__.startswith("bitsandbytes") and not getattr(opt, "is_paged", False)
    cls_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if cls_kwargs is not None:
        cls, kwargs = cls_kwargs
        return cls.__module__.startswith("bitsandbytes") and not kwargs.get("is_paged", False)
    return mode == "on_8bit_embedding" or _optim_name(trainer.args) in EIGHT_BIT_OPTIMS


def install_lowmem(trainer, mode: str, options: dict | None = None, rollout_patch=None) -> LowMemParts:
    """Apply ``memory.lowmem`` to a GRPO/RLOO trainer that passed ``lowmem_problems`` (``enable_rapidfire``
    calls this; the optimizer wrapping, ``rollback="off"`` default and the rollout engine are set up there).

    1. ``on_8bit_embedding``: ``use_8bit_embedding_state`` (the embedding's AdamW state in 8 bits too).
    2. HF gradient checkpointing off (``args.gradient_checkpointing=False``): replaced by 3.
    3. ``apply_chunked_checkpointing(model, rows, forward_rows, offload=True, reuse_host_buffers=True)``.
    4. ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = lm_head_chunk`` (process-wide TRL constant).
    5. ``skip_bitsandbytes_sync_on_default_stream()`` when the optimizer is non-paged bitsandbytes
       (process-wide: do not use paged bitsandbytes optimizers in the same process).
    6. The rollout engine (``rollout_patch``, a ``RolloutPatch``): prefill in ``prefill_rows`` chunks, the
       engine released after every rollout and cuBLAS workspaces cleared.
    """
    opts = lowmem_options(options)
    applied = []
    embedding = None
    if mode == "on_8bit_embedding":
        embedding = use_8bit_embedding_state(trainer)
        applied.append(
            "embedding AdamW state 8-bit too (AdamW8bit via optimizer_cls_and_kwargs; changes math)"
        )
    model = trainer.model
    if trainer.args.gradient_checkpointing or getattr(model, "is_gradient_checkpointing", False):
        trainer.args.gradient_checkpointing = (
            False  # the Trainer would enable it at train(); ours replaces it
        )
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        applied.append("HF gradient checkpointing replaced")
    offloader = apply_chunked_checkpointing(
        model, rows=opts["rows"], forward_rows=opts["forward_rows"], offload=True, reuse_host_buffers=True
    )
    applied.append(
        f"chunked checkpointing ({opts['rows']} rows backward / {opts['forward_rows']} forward, "
        "inputs in pooled pinned host memory; bf16 weight-gradient partials summed in fp32)"
    )
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:  # pragma: no cover - TRL trainers imply TRL
        trl_utils = None
    if trl_utils is not None and hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"):
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = opts["lm_head_chunk"]  # read by TRL's fused LM head each call
        applied.append(f"TRL LM-head vocabulary tile {opts['lm_head_chunk']}")
    bnb_skipped = False
    if _bnb_unpaged(trainer, mode):
        bnb_skipped = skip_bitsandbytes_sync_on_default_stream()
        if bnb_skipped:
            applied.append("bitsandbytes per-parameter syncs skipped on the default stream")
    if rollout_patch is not None:
        rollout_patch.configure_lowmem(prefill_rows=opts["prefill_rows"])
        applied.append(
            f"rollout engine released after each rollout, prefill in {opts['prefill_rows']}-prompt chunks"
        )
    return LowMemParts(mode, opts, offloader, applied, embedding, bnb_skipped)
