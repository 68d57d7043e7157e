"""``RolloutEngine``: one entry point over the fast static engine and the ``model.generate`` fallback."""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

from rapidfire_hf.kernels.kv_quant import kv_format
from rapidfire_hf.rollout.families import family_of
from rapidfire_hf.rollout.generic_forward import generic_unsupported_reason
from rapidfire_hf.rollout.hf_backend import hf_generate
from rapidfire_hf.rollout.llama_forward import unsupported_reason
from rapidfire_hf.rollout.prefill import check_prefill_rows, chunk_prefill, prefill_rows
from rapidfire_hf.rollout.sharded import gathered
from rapidfire_hf.rollout.types import RolloutOutput, SamplingParams

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "static", "hf")


@contextlib.contextmanager
def generation_mode(model):
    """Eval mode and ``no_grad`` for the duration, then the previous train/eval state again.

    Gradient checkpointing needs no switch: HF's checkpointed layers only checkpoint in train mode, and
    the static engine never calls the decoder layers' ``forward``.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


# which forward the static engine runs: the hand-written Llama-family one, or the model's own
DECODE_PATHS = ("native", "generic")


def choose_decode_path(model, gathered: bool = False) -> tuple[str | None, str | None]:
    """``(path, why)``: the static engine's forward for ``model``. ``("native", None)`` where the hand-written
    Llama-family forward runs it (``llama_forward.unsupported_reason`` is None); else ``("generic", why not
    native)`` where the model's own forward can run over the engine's cache (``rollout/generic_forward.py``);
    else ``(None, why neither)``: only ``model.generate`` runs it. ``gathered``: the path it runs inside a gather of
    its ZeRO-3 partitions (PPOTrainer's rollout; the start table asks outside it)."""
    native = unsupported_reason(model, gathered)
    if native is None:
        return "native", None
    generic = generic_unsupported_reason(model, gathered)
    if generic is None:
        return "generic", native
    return None, f"native: {native}; generic: {generic}"


def eight_bit_cache_reason(model) -> str | None:
    """Why the static engine would not read an 8-bit KV cache of ``model`` in its decode attention kernel
    (None: it would): the native path only (:func:`choose_decode_path`), and not a soft-capped attention, which
    dequantizes every slot it reads first (not measured). ``PPOConfig.rollout_kv_cache_dtype="auto"`` asks it
    (``memory.kv_choice``)."""
    if choose_decode_path(model)[0] != "native":
        return "the policy runs the engine's generic decode path"
    config = getattr(model, "config", None)
    family = family_of(config)
    if family is not None and family.softcap and getattr(config, "attn_logit_softcapping", None) is not None:
        return "soft-capped attention dequantizes the cache it reads each step; not measured"
    return None


def resolved_backend(model, backend: str = "auto") -> str:
    """The backend a :class:`RolloutEngine` built on ``model`` with ``backend`` runs: ``"auto"`` is the
    static engine on CUDA for a model it can run (natively or generically, :func:`choose_decode_path`), else
    ``"hf"``. The static engine keeps its KV cache between generations (the throughput planner counts it
    as held through scoring and training)."""
    if backend != "auto":
        return backend
    return (
        "static" if _model_device(model).type == "cuda" and choose_decode_path(model)[0] is not None else "hf"
    )


class RolloutEngine:
    """Generates responses and their log-probs on the model's current (training) weights.

    Args:
        model: an HF causal LM, optionally PEFT-wrapped; used in place, never copied.
        pad_token_id: written after a row's stop token (and used to left-pad prompts internally).
        stop_token_ids: token ids that end a response; None takes ``model.generation_config.eos_token_id``,
            ``[]`` means none.
        backend: "auto" (the static engine on CUDA for a model it can run, else "hf"), "static" (force the
            static engine; also runs on CPU) or "hf" (``model.generate``). The static engine runs the families
            of docs/models.md by its own forward ("native") and other decoder-only causal LMs by the model's own
            forward over its cache ("generic", ``rollout/generic_forward.py``); ``path`` and ``path_reason``
            say which and why (:func:`choose_decode_path`).
        decode_mode: static engine only: "auto", "eager", "cuda_graph" or "compile".
        decode_attention: static engine only: "auto" (default: "triton" on CUDA where Triton runs, else
            "sdpa"; ``kernels.decode_attention.resolve_impl``), "sdpa" (fused GQA attention on CUDA),
            "matmul", or "triton" (the project's split-length flash-decoding kernel, which reads no cache
            slot past the step's, ``kernels/triton_flash_decode.py``).
        decode_sampler: static engine only: "torch" (``rollout/sampling.py``), "triton" (one fused kernel
            on the same noise: the same tokens) or "triton-philox" (the kernel draws its own noise);
            the Triton samplers take temperature only (no top-k / top-p).
        prefill_chunk_rows: static engine only: run the prompt prefill that many prompts at a time, which
            divides the rollout's largest transient (one layer's MLP over every prompt token) by
            ``batch / prefill_chunk_rows`` (``None``: all prompts at once; the hf backend ignores it).
        decode_fuse_projections: static engine only: one matmul for each layer's q/k/v projections and one
            for gate/up in the decode step, from concatenated copies of their weights (refreshed before each
            generation; layers with PEFT, quantized or biased projections keep their modules). Off here by
            default; ``PPOTrainer`` turns it on where its plan has room for the copies
            (``PPOConfig.rollout_decode_fuse_projections="auto"``). 1.1-1.2x on the step on one H200; a PPO update
            1.09x at batch 8 and 1.00x at 32 against the module projections, same calls (``benchmarks/kernels``).
        decode_compile_mode: static engine only: ``torch.compile`` mode of the compiled decode step (None:
            torch's default; ``"max-autotune-no-cudagraphs"``: inductor autotunes the few-row matmuls).
            Opt-in until measured (the ``+autotune`` systems).
        decode_linear: static engine only: the fused projections' matmul in the decode step, ``"torch"`` or
            ``"triton"`` (``kernels/triton_skinny_matmul.py``; needs ``decode_fuse_projections``). Opt-in: it
            lost to cuBLAS in the compiled step (1.646 vs 1.492 ms at 1.1B batch 8, 2.139 vs 1.819 at 64).
        decode_path: static engine only: its forward, "auto" (native where the model's family has one, else
            generic: :func:`choose_decode_path`), "native" or "generic" (the model's own forward over the engine's
            cache, ``rollout/generic_forward.py``; e.g. to compare the two on a Llama). A path that cannot run
            the model raises, naming why.
        decode_fuse_lora: static engine only, with ``decode_fuse_projections``: layers whose projections are
            PEFT LoRA layers are fused too (base weights concatenated; the LoRA factors stacked, one matmul by
            all ``A`` and one by the block-diagonal ``B`` per group). Opt-in: not yet measured on a GPU.
        kv_cache_dtype: static engine, native path only: None (the KV cache in the model's dtype), ``"fp8"``
            (e4m3) or ``"int8"``: 8-bit elements with one fp32 scale per (row, K/V head, token)
            (``kernels/kv_quant.py``), 0.516x the cache bytes of bf16 at head width 128, so twice the rows fit
            in the same memory. Changes the arithmetic (greedy tokens may differ from a bf16 cache's). Refused
            by name where it cannot act: the hf backend (``model.generate`` keeps its own cache) and the
            generic path. Opt-in (``PPOConfig.rollout_kv_cache_dtype``).

    Example:
        >>> engine = RolloutEngine(policy, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id])
        >>> out = engine.generate(batch["input_ids"], batch["attention_mask"],
        ...                       SamplingParams(max_new_tokens=64, temperature=0.7))
        >>> out.responses.shape, out.logprobs.dtype
        (torch.Size([8, 64]), torch.float32)

    Create the engine once and reuse it: the static engine keeps its KV cache and recorded CUDA graphs
    between calls of the same batch shape (prompts are left-padded to a multiple of 32 columns, so
    slightly different prompt widths share them). Call :meth:`release` before a phase that needs the
    memory back (at B=256, 512 tokens, the 1.1B shape: ~2.9 GB of cache).

    Raises:
        ValueError: an unknown backend, or "static" forced on a model it cannot run.
    """

    def __init__(
        self,
        model,
        pad_token_id: int,
        stop_token_ids: list[int] | None = None,
        backend: str = "auto",
        decode_mode: str = "auto",
        decode_attention: str = "auto",
        prefill_chunk_rows: int | None = None,
        decode_sampler: str = "torch",
        decode_fuse_projections: bool = False,
        decode_compile_mode: str | None = None,
        decode_linear: str = "torch",
        decode_fuse_lora: bool = False,
        decode_path: str = "auto",
        kv_cache_dtype: str | None = None,
    ):
        kv_format(kv_cache_dtype)  # a bad value is named before anything else
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if prefill_chunk_rows is not None:
            check_prefill_rows(prefill_chunk_rows)
        # DDP: generation needs no gradient sync, so work on the wrapped module (same weights)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.stop_token_ids = self._resolve_stops(model, stop_token_ids)
        if decode_path not in ("auto", *DECODE_PATHS):
            raise ValueError(f"decode_path must be one of {('auto', *DECODE_PATHS)}, got {decode_path!r}")
        forced = decode_path
        path, reason = choose_decode_path(model)
        if forced != "auto" and forced != path:
            why_not = unsupported_reason(model) if forced == "native" else generic_unsupported_reason(model)
            if why_not is not None:
                raise ValueError(f"decode_path={forced!r} cannot run this model ({why_not})")
            path, reason = forced, f"decode_path={forced!r}"
        if backend == "static" and path is None:
            raise ValueError(f"backend='static' cannot run this model ({reason}); use backend='hf'")
        if backend == "auto" and _model_device(model).type == "cuda":
            if path is None:
                logger.info("rapidfire rollout: using model.generate (%s)", reason)
            elif path == "generic":
                logger.info("rapidfire rollout: the model's own forward over the static cache (%s)", reason)
        backend = resolved_backend(model, backend)
        self.backend = backend
        # "native" / "generic" (the static engine's forward) or "model.generate"; why not native in path_reason
        self.path = path if backend == "static" else "model.generate"
        self.path_reason = reason if backend == "static" else (reason or "backend='hf'")
        static_only = {
            "decode_attention": (decode_attention, "auto"),
            "decode_sampler": (decode_sampler, "torch"),
            "decode_fuse_projections": (decode_fuse_projections, False),
            "decode_compile_mode": (decode_compile_mode, None),
            "decode_linear": (decode_linear, "torch"),
            "decode_fuse_lora": (decode_fuse_lora, False),
            "decode_path": (forced, "auto"),
        }
        ignored = [f"{k}={v!r}" for k, (v, default) in static_only.items() if v != default]
        native_only = [
            f"{k}={v!r}"
            for k, (v, default) in static_only.items()
            if v != default and k not in ("decode_sampler", "decode_fuse_projections", "decode_path")
        ]
        if self.path == "generic" and native_only:
            # the generic step is the model's own forward: no attention kernel, projections or LoRA of ours in it
            warnings.warn(
                f"{', '.join(native_only)} apply to the native decode path only; this model runs the generic "
                f"path ({reason}), so they are not used",
                stacklevel=2,
            )
        if backend == "hf" and ignored:
            # said once per engine: the hf backend has no decode step of its own to put them in
            warnings.warn(
                f"{', '.join(ignored)} apply to the static engine only; this engine runs model.generate "
                f"({reason or 'backend=' + repr(backend)}), so they are not used",
                stacklevel=2,
            )
        if kv_cache_dtype is not None and self.path != "native":
            # an 8-bit cache changes the arithmetic and the memory plan: never dropped without a word
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs the static engine's native decode path; this engine "
                f"runs {self.path!r} ({self.path_reason})"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self._static = None
        self._generated = False  # model.generate has run (decode_mode_ran)
        if backend == "static":
            from rapidfire_hf.rollout.static_engine import StaticEngine

            self._static = StaticEngine(
                model,
                self.pad_token_id,
                self.stop_token_ids,
                decode_mode,
                attention=decode_attention,
                prefill_rows=prefill_chunk_rows,
                sampler=decode_sampler,
                fuse_projections=decode_fuse_projections,
                compile_mode=decode_compile_mode,
                linear=decode_linear,
                fuse_lora=decode_fuse_lora,
                path=path,
                kv_cache_dtype=kv_cache_dtype,
            )

    def compiles_decode(self, device: torch.device) -> bool:
        """Whether the decode step may run under ``torch.compile`` on ``device`` (static backend on CUDA,
        decode_mode "compile" or "auto"); callers that change what the step reads between calls (the
        sweep's adapter route) keep it in tensors then, so the compiled step is reused."""
        return (
            self._static is not None
            and torch.device(device).type == "cuda"
            and self._static.decode_mode in ("auto", "compile")
        )

    @property
    def prefill_chunk_rows(self) -> int | None:
        """Prompts per prefill chunk (``None``: not chunked, or the hf backend)."""
        return prefill_rows(self._static.net) if self._static is not None else None

    def chunk_prefill(self, rows: int) -> bool:
        """Run the prefill ``rows`` prompts at a time from now on; whether it is chunked (static backend).

        An engine already chunked keeps its chunk size.
        """
        check_prefill_rows(rows)
        if self._static is None:
            return False
        if self.prefill_chunk_rows is None:
            chunk_prefill(self._static.net, rows)
        return True

    def held_bytes(self) -> int:
        """Bytes the engine keeps allocated between generations (the static engine's KV cache and step
        buffers; 0 for ``model.generate``, which frees its cache when it returns)."""
        return self._static.held_bytes() if self._static is not None else 0

    def copy_bytes(self) -> int:
        """Bytes of the fused decode projections' weight copies allocated so far (``decode_fuse_projections``;
        kept for the engine's life, refreshed in place before each generation; 0 without them)."""
        return self._static.net.fused_bytes() if self._static is not None else 0

    @property
    def decode_mode_ran(self) -> str | None:
        """How the last generation's decode steps ran: ``"compile"``, ``"cuda_graph"`` or ``"eager"`` (the static
        engine, after any fall back to a lower mode), ``"generate"`` (``model.generate``); None before the first."""
        if self._static is None:
            return "generate" if self._generated else None
        return self._static.mode_ran

    @property
    def decode_fallbacks(self) -> tuple[str, ...]:
        """Each time the decode step could not run in its mode and ran one mode down, in order
        (``"compile -> cuda_graph: <error>"``); each was also warned once, when it happened."""
        return tuple(self._static.fallbacks) if self._static is not None else ()

    def release(self) -> None:
        """Free the static engine's KV cache, buffers and recorded graphs (rebuilt on the next call)."""
        if self._static is not None:
            self._static.release()

    @staticmethod
    def _resolve_stops(model, stop_token_ids) -> list[int]:
        if stop_token_ids is not None:
            return [int(t) for t in stop_token_ids]
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return []
        return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample one response per prompt.

        Args:
            input_ids: ``[B, P]`` left-padded prompt token ids (every row needs at least one real token).
            attention_mask: ``[B, P]`` 1 for real tokens (default: all ones).
            params: sampling settings (default ``SamplingParams()``).
            generator: makes the draw reproducible: the same seed gives the same tokens. The static backend
                also takes a list of ``(rows, generator)`` pairs: one generator per block of consecutive rows.

        Returns:
            A :class:`RolloutOutput` with ``R = params.max_new_tokens`` response columns.
        """
        params = params or SamplingParams()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        device = _model_device(self.model)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if not bool(attention_mask[:, -1].all()):
            raise ValueError("prompts must be left-padded: attention_mask[:, -1] must be 1 for every row")
        if isinstance(generator, (list, tuple)) and self._static is None:
            raise ValueError(
                "per-row generators need backend='static' (model.generate draws one batch-wide sample)"
            )
        # the static engine: FSDP2 units gathered once for the whole rollout (rollout/sharded.py; nothing for
        # unsharded models). model.generate keeps its per-layer gathers, which hold one layer at a time
        static_gather = gathered(self.model) if self._static is not None else contextlib.nullcontext()
        with generation_mode(self.model), static_gather:
            if self._static is not None:
                tokens, logprobs = self._static.generate(input_ids, attention_mask, params, generator)
            else:
                tokens, logprobs = hf_generate(
                    self.model,
                    input_ids,
                    attention_mask,
                    params,
                    self.pad_token_id,
                    self.stop_token_ids,
                    generator,
                )
                self._generated = True
        return self._finish(input_ids, tokens, logprobs, params.max_new_tokens)

    def _finish(self, input_ids, tokens, logprobs, r: int) -> RolloutOutput:
        """Pad to ``r`` columns, mask everything after the first stop token, assemble the output."""
        missing = r - tokens.shape[1]
        if missing > 0:
            tokens = torch.cat(
                [tokens, tokens.new_full((tokens.shape[0], missing), self.pad_token_id)], dim=1
            )
            logprobs = torch.cat([logprobs, logprobs.new_zeros(logprobs.shape[0], missing)], dim=1)
        if self.stop_token_ids:
            stops = torch.tensor(self.stop_token_ids, device=tokens.device)
            is_stop = torch.isin(tokens, stops).long()
            mask = (is_stop.cumsum(-1) - is_stop) == 0
        else:
            mask = torch.ones_like(tokens, dtype=torch.bool)
        responses = tokens.masked_fill(~mask, self.pad_token_id)
        logprobs = logprobs.float().masked_fill(~mask, 0.0)
        return RolloutOutput(
            sequences=torch.cat([input_ids, responses], dim=1),
            responses=responses,
            logprobs=logprobs,
            response_mask=mask,
            prompt_length=input_ids.shape[1],
        )
