"""Chunked, host-offloaded activation checkpointing of decoder layers (``apply_chunked_checkpointing``).

Why: with full checkpointing (HF's ``gradient_checkpointing=True``, or
``apply_selective_checkpointing(model, "aggressive")``) every decoder layer's input stays on the GPU until
backward (for a 1.1B Llama at 64 sequences x 384 tokens: 22 x 64 x 384 x 2048 x 2 bytes = 2.06 GiB), and
backward recomputes one whole layer for all tokens at once (~2-2.5 GiB of saved activations plus their
gradients there, the MLP's intermediates dominating).

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
fp32 the summation order.

Limits: no RNG state is replayed in the recompute (fine for Llama, whose attention dropout is 0 and
TRL disables dropout); keyword tensors whose first dimension equals the batch (attention masks,
per-row position ids) are sliced per chunk, others are passed whole; the module must return a tensor
(or a tuple whose first element is the tensor and whose other elements are not tensors).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from rapidfire_hf.memory.offload import HostOffloader
from rapidfire_hf.models import decoder_layers, final_norm


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


class ChunkedCheckpoint(torch.autograd.Function):
    """``run(hidden, **kwargs)`` with its input saved by ``offloader`` and backward recomputed by chunks.

    ``rows`` is the backward chunk (sequences), or ``(rows, forward_rows)`` for a different forward chunk.
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


def checkpoint_module_in_chunks(
    module: torch.nn.Module, rows: int | tuple[int, int], offloader: HostOffloader
) -> None:
    """Replace ``module.forward`` (instance attribute) with a ``ChunkedCheckpoint`` of it.

    Training calls (grad enabled, ``module.training``, hidden states as the one positional argument) go
    through the chunked checkpoint with the KV cache off; any other call runs the original forward.
    """
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
        out = ChunkedCheckpoint.apply(hidden_states, run, kwargs, rows, offloader, *params)
        return out if run.rest is None else (out, *run.rest)  # e.g. (hidden, None) from older layers

    module.forward = forward
    module._rapidfire_chunked_checkpoint = (rows, offloader)


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
            of allocating them every forward (``HostOffloader``).
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
        checkpoint_module_in_chunks(layer, chunking, offloader)
    if include_final_norm:
        norm = final_norm(model)
        if norm is not None:
            checkpoint_module_in_chunks(norm, chunking, offloader)
    return offloader
