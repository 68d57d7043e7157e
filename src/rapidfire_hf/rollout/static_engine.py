"""The fast rollout loop: static KV cache, one prefill, then a decode step that can be graph-captured.

Every decode step is a pure function of a fixed set of tensors (cache, masks, rotary table, output
buffers, a step counter and uniform noise), all allocated once per batch shape, so on CUDA the step is
recorded once into a CUDA graph (optionally after ``torch.compile``) and replayed; per step the host
only writes the counter and draws the noise from the caller's generator. Prompts are left-padded up to a
multiple of ``prompt_bucket`` so batches of slightly different prompt widths reuse the same buffers.
"""

from __future__ import annotations

import warnings

import torch

from rapidfire_hf.kernels.decode_attention import resolve_impl, triton_unavailable_reason
from rapidfire_hf.rollout.generic_forward import GenericNet
from rapidfire_hf.rollout.llama_forward import StaticLlama, unsupported_reason
from rapidfire_hf.rollout.prefill import chunk_prefill
from rapidfire_hf.rollout.sampling import philox_seeds, sample_tokens
from rapidfire_hf.rollout.types import SamplingParams

DECODE_MODES = ("eager", "cuda_graph", "compile")
# "torch": sample_tokens (rollout/sampling.py); "triton": the fused kernel on the same noise (same tokens);
# "triton-philox": the fused kernel drawing its own noise (no [B, V] noise written by the host per step)
SAMPLERS = ("torch", "triton", "triton-philox")
# torch.compile modes for the decode step: None (torch's default) or inductor's autotuning without its own
# CUDA graphs (this engine records the step itself)
COMPILE_MODES = (None, "max-autotune-no-cudagraphs")
# host reads "are all rows finished?" only this often: each read is a device sync
_STOP_CHECK_EVERY = 16
# attention reads the cache up to the next multiple of this many slots, not all of it: at 128 + 384
# tokens the average step then reads ~330 instead of 512 slots (the KV cache is ~57% of the bytes a
# step reads at batch 256 on the 1.1B shape); each bucket is one more recorded CUDA graph
KV_BUCKET = 64
# "auto" compiles the step for at most this many (batch, prompt, response) shapes per engine, then
# records new shapes uncompiled: each compilation costs ~20 s (H200, 1.1B), and datasets whose prompt
# widths vary would otherwise pay it again and again
MAX_COMPILED_SHAPES = 4


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def warmup_stream(device: int | None = None) -> torch.cuda.Stream:
    """The one side stream (per device) on which every decode graph is warmed up before it is recorded.

    cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run a GEMM on, and torch frees them
    only on ``torch._C._cuda_clearCublasWorkspaces()``. A fresh ``torch.cuda.Stream()`` per recording left
    one more workspace behind every time graphs are recorded again (after ``release()``, a new batch shape
    or new sampling settings), up to the 32 streams of torch's pool: +0.031 GiB a step when the engine is
    released after every rollout (benchmarks/grpo, ``rapidfire_lowmem2`` on the H200). Reusing one stream
    keeps it at one workspace.
    """
    index = torch.cuda.current_device() if device is None else device
    stream = _WARMUP_STREAMS.get(index)
    if stream is None:
        stream = _WARMUP_STREAMS[index] = torch.cuda.Stream(index)
    return stream


class _Buffers:
    """The tensors one decode step reads and writes, for one ``(B, P, R)`` shape."""

    def __init__(self, net: StaticLlama | GenericNet, b: int, p: int, r: int, vocab: int, device):
        self.shape = (b, p, r)
        self.k, self.v = net.new_cache(b, p + r, device)
        # an 8-bit cache's per-slot scales ([B, KV, L] fp32 per layer each; StaticLlama.new_cache_scales)
        scales = net.new_cache_scales(b, p + r, device) if isinstance(net, StaticLlama) else None
        self.k_scale, self.v_scale = scales if scales is not None else (None, None)
        self.key_valid = torch.zeros(b, p + r, dtype=torch.bool, device=device)
        self.cos = self.sin = None  # [T, B, L, Dr] per rotary table, set per batch
        self.tokens = torch.zeros(b, r, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(b, r, dtype=torch.float32, device=device)
        self.step = torch.ones(1, dtype=torch.long, device=device)
        self.noise = torch.empty(b, vocab, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(b, dtype=torch.long, device=device)  # Philox seeds ("triton-philox")
        self.stops = None  # [S] int64


def _peft_layers(model) -> list:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class StaticEngine:
    """Generation over a static cache (see module docstring), by the native or the generic forward.

    Args:
        model: HF causal LM (optionally PEFT-wrapped); its modules are used as they are.
        pad_token_id: written after a row has stopped.
        stop_token_ids: token ids that end a row.
        decode_mode: "eager", "cuda_graph" (record the step once, replay it), "compile" (``torch.compile``
            then record) or "auto": on CUDA "compile" for the first ``MAX_COMPILED_SHAPES`` batch shapes
            and "cuda_graph" after them (H200, 1.1B Llama, 128 + 384 tokens: 1.79 ms per decode step
            compiled against 3.22 ms recorded uncompiled at batch 8, 1.88 against 3.46 at batch 32;
            benchmarks/rollout/results); eager elsewhere.
        prompt_bucket: prompts are left-padded to a multiple of this width so shapes repeat.
        attention: decode attention, "auto" (the Triton kernel on CUDA where it runs, else "sdpa"), "sdpa"
            (fused on CUDA), "matmul" or "triton" (see ``gqa_decode_attention`` and ``resolve_impl``).
        prefill_rows: run the prompt prefill that many prompts at a time (``rollout.prefill.chunk_prefill``;
            ``None``: all at once).
        fuse_projections: one matmul for q/k/v and one for gate/up per layer in the decode step
            (``StaticLlama``; a faster step: PPO 1.09x at batch 8, 1.00x at 32 on the H200; see
            ``RolloutEngine``).
        compile_mode: ``torch.compile``'s ``mode`` for the compiled step (None: its default); e.g.
            ``"max-autotune-no-cudagraphs"`` lets inductor time Triton GEMM templates against cuBLAS for the
            decode's few-row matmuls (the step is recorded as a CUDA graph here either way). Opt-in: longer
            compilation, not yet measured.
        linear: the fused decode projections' matmul, ``"torch"`` or ``"triton"`` (the skinny matmul;
            ``StaticLlama``; needs ``fuse_projections``; opt-in, not yet measured on a GPU).
        fuse_lora: with ``fuse_projections``, PEFT LoRA layers fused too (``StaticLlama``; opt-in, not yet
            measured on a GPU).
        kv_cache_dtype: None (the model's dtype), ``"fp8"`` or ``"int8"``: an 8-bit KV cache with per-(row,
            head, token) scales (``StaticLlama``, ``kernels/kv_quant.py``). The native path only: refused by
            name for the generic one (the model's own attention reads its cache in the model's dtype).
        path: the forward of the step: "native" (``StaticLlama``, the families of docs/models.md), "generic" (the
            model's own forward over this engine's cache, ``GenericNet``; any decoder-only causal LM it can run)
            or "auto": native where ``llama_forward.unsupported_reason`` is None, else generic. The generic
            path ignores ``attention``, ``fuse_projections``, ``linear`` and ``fuse_lora``.
    """

    def __init__(
        self,
        model,
        pad_token_id: int,
        stop_token_ids: list[int],
        decode_mode: str = "auto",
        prompt_bucket: int = 32,
        attention: str = "auto",
        prefill_rows: int | None = None,
        sampler: str = "torch",
        fuse_projections: bool = False,
        compile_mode: str | None = None,
        linear: str = "torch",
        fuse_lora: bool = False,
        path: str = "auto",
        kv_cache_dtype: str | None = None,
    ):
        if path not in ("auto", "native", "generic"):
            raise ValueError(f"path must be 'auto', 'native' or 'generic', got {path!r}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.sampler = sampler
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
        self.compile_mode = compile_mode
        attention = resolve_impl(attention, next(model.parameters()).device, recorded=decode_mode != "eager")
        self.attention = attention  # what "auto" became on this model's device
        if attention == "triton" or sampler != "torch" or linear != "torch":
            reason = triton_unavailable_reason(next(model.parameters()).device)
            if reason is not None:
                raise ValueError(
                    f"attention={attention!r} / sampler={sampler!r} / linear={linear!r} cannot run here: {reason}"
                )
        if path == "native" or (path == "auto" and unsupported_reason(model) is None):
            self.net = StaticLlama(
                model,
                attention,
                fuse_projections=fuse_projections,
                linear=linear,
                fuse_lora=fuse_lora,
                kv_cache_dtype=kv_cache_dtype,
            )
        elif kv_cache_dtype is not None:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs the native decode path; this model runs the generic "
                f"path (the model's own attention, which reads its cache in the model's dtype): "
                f"{unsupported_reason(model) or 'path=' + repr(path)}"
            )
        else:  # the model's own forward over this engine's cache (rollout/generic_forward.py)
            self.net = GenericNet(model)
        if prefill_rows is not None:
            chunk_prefill(self.net, prefill_rows)
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        if decode_mode not in (*DECODE_MODES, "auto"):
            raise ValueError(f"decode_mode must be one of {DECODE_MODES + ('auto',)}, got {decode_mode!r}")
        self.decode_mode = decode_mode
        self.prompt_bucket = max(1, prompt_bucket)
        self._buf: _Buffers | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # kv_len -> recorded step
        self._graph_key = None
        self._pool = None
        self._weights_id = ()
        # PEFT tuner layers (LoRA etc.): `with model.disable_adapter()` flips a Python flag the graph can't see
        self._adapter_layers = _peft_layers(model)
        self._compiled = None
        self._compiled_shapes: set[tuple] = set()
        self.step_callback = None  # called with t after each decode step (timing, progress); None = off
        self.mode_ran: str | None = None  # the mode the last generation's decode steps ran (None: none yet)
        self.fallbacks: list[str] = []  # each fall back to a lower mode, "compile -> cuda_graph: <error>"

    def held_bytes(self) -> int:
        """Bytes of the KV cache and step buffers kept for the next generation (0 after ``release``)."""
        if self._buf is None:
            return 0
        total = 0
        for value in vars(self._buf).values():
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def release(self) -> None:
        """Drop the cache, buffers, recorded graphs and their memory pool."""
        self._buf, self._graphs, self._graph_key, self._pool = None, {}, None, None

    def _mode(self, device: torch.device) -> str:
        if device.type != "cuda":
            return "eager"
        if self.decode_mode != "auto":
            return self.decode_mode
        shape = self._buf.shape
        if shape in self._compiled_shapes or len(self._compiled_shapes) < MAX_COMPILED_SHAPES:
            self._compiled_shapes.add(shape)
            return "compile"
        return "cuda_graph"

    # ----- the step -------------------------------------------------------------------------------
    def _step(self, params: SamplingParams, kv_len: int) -> None:
        """Decode step ``t = buf.step``: feed token ``t-1``, write token ``t`` and its log-prob.

        Attention reads only cache slots ``[0, kv_len)``; ``kv_len`` is a Python int (one graph per value).
        """
        buf = self._buf
        _, p, r = buf.shape
        t = buf.step
        slot = t + (p - 1)
        prev = buf.tokens.index_select(1, t - 1).squeeze(1)
        buf.key_valid.index_fill_(1, slot, True)
        cos = buf.cos.index_select(2, slot).squeeze(2)
        sin = buf.sin.index_select(2, slot).squeeze(2)
        hidden = self.net.decode(prev, slot, cos, sin, buf.key_valid, buf.k, buf.v, kv_len, **self._scales())
        tok, lp = self._sample(hidden, params)
        # a row is done when a stop token sits among its tokens 0..t-1 (recomputed, so the step is idempotent)
        earlier = torch.arange(r, device=t.device)[None, :] < t
        done = ((buf.tokens[:, :, None] == buf.stops).any(-1) & earlier).any(-1)
        tok = torch.where(done, self.pad_token_id, tok)
        lp = torch.where(done, 0.0, lp)
        buf.tokens.index_copy_(1, t, tok[:, None])
        buf.logprobs.index_copy_(1, t, lp[:, None])

    def _scales(self) -> dict:
        """The forward's ``scales=`` argument for an 8-bit cache (nothing otherwise: the generic forward
        takes none)."""
        buf = self._buf
        return {} if buf.k_scale is None else {"scales": (buf.k_scale, buf.v_scale)}

    def _sample(self, hidden: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log-probs of step ``buf.step`` from the final hidden states, with the engine's sampler."""
        buf = self._buf
        if self.sampler == "torch":
            return sample_tokens(self.net.logits(hidden), params, buf.noise if params.do_sample else None)
        from rapidfire_hf.kernels.triton_sampling import fused_sample

        philox = self.sampler == "triton-philox"
        return fused_sample(
            self.net.head(hidden),  # the model's dtype: the kernel reads it and computes in fp32
            params.temperature,
            params.do_sample,
            noise_uniform=buf.noise if params.do_sample and not philox else None,
            seeds=buf.seeds if params.do_sample and philox else None,
            step=buf.step,
        )

    def _kv_len(self, mode: str, t: int) -> int:
        """Cache slots step ``t`` must read, rounded up to a multiple of ``KV_BUCKET`` (whole cache when compiled)."""
        _, p, r = self._buf.shape
        if mode == "compile":
            return p + r  # one shape: each distinct length would be a fresh compilation
        return min(p + r, -(-(p + t) // KV_BUCKET) * KV_BUCKET)

    def _run_step(self, params: SamplingParams, mode: str, t: int) -> None:
        """Run decode step ``t``: eagerly, or by replaying (recording first if needed) its CUDA graph."""
        kv_len = self._kv_len(mode, t)
        if mode == "eager":
            self._step(params, kv_len)
            return
        # recorded graphs hold raw addresses: a new shape, new settings or moved weights need new ones
        key = (self._buf.shape, params, mode, self._weights_id)
        if self._graph_key != key:
            self._reset_graphs()
            self._graph_key = key
        graph = self._graphs.get(kv_len)
        if graph is None:
            graph = self._graphs[kv_len] = self._record(lambda: self._step_fn(mode)(params, kv_len))
        graph.replay()

    def _step_fn(self, mode: str):
        if mode != "compile":
            return self._step
        if self._compiled is None:
            self._compiled = torch.compile(self._step, dynamic=False, mode=self.compile_mode)
        return self._compiled

    def _reset_graphs(self) -> None:
        """Drop the recorded graphs together with their memory pool.

        Re-using a pool handle after every graph recorded into it was freed trips an internal assert
        of the CUDA caching allocator at the next capture (seen on the H200 with torch 2.11 when the
        sampling settings changed between two generate calls), so a new pool goes with new graphs.
        """
        self._graphs, self._graph_key, self._pool = {}, None, None

    def _record(self, step) -> torch.cuda.CUDAGraph:
        # warm-up on a side stream (cuBLAS workspaces, compilation), then record; the step is idempotent
        stream = warmup_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        return graph

    # ----- the loop -------------------------------------------------------------------------------
    def _prepare(self, input_ids, attention_mask, r: int) -> _Buffers:
        b, p = input_ids.shape
        device = input_ids.device
        shape = (b, p, r)
        if self._buf is None or self._buf.shape != shape or self._buf.k[0].device != device:
            self._buf = None
            self._reset_graphs()
            self._buf = _Buffers(self.net, b, p, r, self.net.lm_head.weight.shape[0], device)
        buf = self._buf
        n_real = attention_mask.sum(-1, keepdim=True)
        prompt_pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        gen_pos = n_real + torch.arange(r, device=device)[None, :]
        cos, sin = self.net.rope_table(torch.cat([prompt_pos, gen_pos], dim=1))
        if buf.cos is None:
            buf.cos, buf.sin = cos.contiguous(), sin.contiguous()
        else:
            buf.cos.copy_(cos)
            buf.sin.copy_(sin)
        buf.key_valid.zero_()
        buf.key_valid[:, :p] = attention_mask.bool()
        if buf.stops is None:  # the engine's stop ids are fixed: set once per buffer (no host round trip)
            buf.stops = torch.tensor(self.stop_token_ids or [-1], dtype=torch.long, device=device)
        buf.tokens.fill_(self.pad_token_id)
        buf.logprobs.zero_()
        return buf

    def generate(self, input_ids, attention_mask, params: SamplingParams, generator=None):
        """Prefill and decode ``params.max_new_tokens`` tokens (model already in eval, under no_grad).

        Args:
            input_ids: ``[B, P]`` left-padded prompts.
            attention_mask: ``[B, P]`` 1 for real tokens.
            params: sampling settings.
            generator: seeds the sampling noise (a generator on another device seeds one on the model's);
                or a list of ``(rows, generator)`` pairs: each block of consecutive rows draws its noise
                from its own generator, so a block's tokens do not depend on the rows beside it.

        Returns:
            ``(tokens [B, R], logprobs [B, R])``, pad / 0 after a stop token.
        """
        device = input_ids.device
        b, p = input_ids.shape
        extra = -p % self.prompt_bucket
        if extra:
            input_ids = torch.cat([input_ids.new_full((b, extra), self.pad_token_id), input_ids], dim=1)
            attention_mask = torch.cat([attention_mask.new_zeros(b, extra), attention_mask], dim=1)
            p += extra
        r = params.max_new_tokens
        if self.sampler != "torch" and (params.top_k > 0 or params.top_p < 1.0):
            raise ValueError(
                f"sampler={self.sampler!r} fuses temperature sampling only; top_k={params.top_k} / "
                f"top_p={params.top_p} need sampler='torch'"
            )
        buf = self._prepare(input_ids, attention_mask, r)
        self.net.refresh_fused()  # the weights of the last update into the fused projections (in place)
        generator = _row_generators(generator, b, device)
        # per-step host noise, except when the kernel draws its own (seeded once per call)
        host_noise = params.do_sample and self.sampler != "triton-philox"
        if params.do_sample and not host_noise:
            _fill_seeds(buf.seeds, generator)

        hidden = self.net.prefill(
            input_ids, attention_mask, buf.cos[:, :, :p], buf.sin[:, :, :p], buf.k, buf.v, **self._scales()
        )
        if host_noise:
            _fill_noise(buf.noise, generator)
        buf.step.fill_(0)
        tok, lp = self._sample(hidden, params)
        buf.tokens[:, 0] = tok
        buf.logprobs[:, 0] = lp
        mode = self._mode(device)
        self._weights_id = self._structure_id()
        for t in range(1, r):
            if t % _STOP_CHECK_EVERY == 0 and self._all_stopped(buf, t):
                break
            buf.step.fill_(t)
            if host_noise:
                _fill_noise(buf.noise, generator)
            mode = self._run_step_or_fall_back(params, mode, t)
            if self.step_callback is not None:
                self.step_callback(t)
        self.mode_ran = mode
        return buf.tokens.clone(), buf.logprobs.clone()

    def _run_step_or_fall_back(self, params: SamplingParams, mode: str, t: int) -> str:
        """Run step ``t`` in ``mode``; where that fails, warn once and run it (and every later step of this
        engine) one mode down: compiled -> recorded -> eager. A compiler failure, or a module the decode step
        calls that cannot be recorded (a data-dependent MoE routing loop in some transformers versions), costs
        speed, never the rollout; the step is idempotent, so re-running it is exact. Returns the mode used."""
        while True:
            try:
                self._run_step(params, mode, t)
                return mode
            except Exception as exc:
                lower = {"compile": "cuda_graph", "cuda_graph": "eager"}.get(mode)
                if lower is None:
                    raise
                what = (
                    "torch.compile of the decode step" if mode == "compile" else "recording the decode step"
                )
                warnings.warn(f"{what} failed ({exc!r}); running it as decode_mode={lower!r}", stacklevel=3)
                self.fallbacks.append(f"{mode} -> {lower}: {exc!r}"[:300])
                self._reset_graphs()
                self.decode_mode = mode = lower

    def _structure_id(self) -> tuple:
        """What a recorded graph bakes in: weight addresses and PEFT adapter switches (disabled, merged, active)."""
        adapters = tuple(
            (bool(m.disable_adapters), bool(getattr(m, "merged", False)), tuple(m.active_adapters))
            for m in self._adapter_layers
        )
        held = (*self.model.parameters(), *self.net.fused_weights(), *self.net.norm_scales())
        weights = tuple(q.data_ptr() for q in held)
        return weights, adapters

    def _all_stopped(self, buf: _Buffers, t: int) -> bool:
        return bool((buf.tokens[:, :t, None] == buf.stops).any(-1).any(-1).all())


def _on_device(generator: torch.Generator | None, device) -> torch.Generator | None:
    """``generator``, or one on ``device`` seeded from it when it lives elsewhere."""
    if generator is None or generator.device == device:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device).manual_seed(seed)


def _row_generators(generator, batch: int, device):
    """One generator (or None), or ``[(rows, generator), ...]`` blocks covering all ``batch`` rows in order."""
    if not isinstance(generator, (list, tuple)):
        return _on_device(generator, device)
    total = sum(rows for rows, _ in generator)
    if total != batch:
        raise ValueError(
            f"per-row generators cover {total} rows but the batch has {batch}: give one block per row group"
        )
    return [(rows, _on_device(gen, device)) for rows, gen in generator]


def _fill_noise(noise: torch.Tensor, generator) -> None:
    """Uniform(0, 1) noise into ``noise`` ``[B, V]``: from one generator, or block by block (see generate)."""
    if not isinstance(generator, list):
        noise.uniform_(generator=generator)
        return
    start = 0
    for rows, gen in generator:
        noise[start : start + rows].uniform_(generator=gen)
        start += rows


def _fill_seeds(seeds: torch.Tensor, generator) -> None:
    """``[B]`` Philox seeds for the fused sampler: from one generator, or block by block (see generate)."""
    blocks = generator if isinstance(generator, list) else [(seeds.shape[0], generator)]
    start = 0
    for rows, gen in blocks:
        seeds[start : start + rows].copy_(philox_seeds(gen, rows, seeds.device))
        start += rows
