"""An estimate of GPU memory per phase of one GRPO step of ``run.py``'s workload, computed on the CPU.

The variants are the memory stacks of the stored runs in ``results/h200/`` (see README.md):
``rapidfire_lowmem3`` has the memory layout of today's ``run.py`` variant ``rapidfire_lowmem`` (the
``memory.lowmem`` switch; its pooled host buffers and skipped syncs change time, not GPU memory).

Not a measurement: the 1.1B model is built on PyTorch's ``meta`` device (shapes only, no data), the
training step of TRL's GRPO loss path is run on it, and a ``TorchDispatchMode`` adds up the bytes of
every tensor storage while it is alive (freed when its last reference goes). That counts what the
caching allocator would hand out, without its rounding and fragmentation, cuBLAS workspaces or
kernel-internal scratch. Three GPU-only kernels are stood in for by what they allocate:

- attention: flash SDPA (``is_causal``, GQA in the kernel, as transformers uses it on CUDA when no
  row is padded): saves its output and an fp32 log-sum-exp; backward allocates dq/dk/dv, an fp32
  ``dq`` accumulator and the expanded dk/dv of GQA. (On ``meta`` SDPA would take the math path and
  materialise the ``[B, H, S, S]`` scores.)
- TRL's fused LM head: ``trl.kernels.ChunkedLogProbFunction`` runs as is (its tile buffer and its fp32
  gradient accumulators are real allocations); its Triton fold kernels and its CUDA fp32-accumulating
  ``addmm(out_dtype=float32)`` allocate nothing, so the torch fallbacks that stand in for them on other
  devices are replaced by no-ops here. The valid
  positions are gathered as TRL's compact (Triton) path does, assuming full-length completions.
- the gradient pipeline (``rapidfire_lowmem2``, ``rapidfire_lowmem3``): post-accumulate-grad hooks free
  gradients in buckets of 64 MiB (RapidFireOptimizer's default bucket size), in the order they complete.

Weights and optimizer state are added from the parameter count (``static``): bf16 weights; stock's
fused AdamW keeps two bf16 moments (4 bytes/parameter); bitsandbytes' 8-bit AdamW two uint8 moments
(2 bytes/parameter) except ``nn.Embedding`` weights, which transformers keeps in 32 bits (8
bytes/parameter), plus one fp32 absmax per 256-element block of each 8-bit moment; tensors under 4096
elements also stay 32-bit. ``rapidfire_lowmem3`` builds ``AdamW8bit`` without that embedding override
(``adamw_8bit_all``: the embedding's state is 8-bit too).

Not counted (add them when comparing with a measurement): cuBLAS keeps a workspace per stream it ran
a GEMM on (32 MiB on Hopper), and in the stored H200 runs the rollout engine's warm-up streams added one
per rollout (``memory.stats.clear_cublas_workspaces``); about 0.03 GiB (training) to 0.1 GiB (rollout) when
they are cleared after each rollout.

Generation is estimated from shapes (rapidfire_hf's static rollout engine: KV cache of batch x (prompt
+ completion) slots, prefill of the whole batch or, for ``rapidfire_lowmem3``, of ``--prefill-rows``
prompts at a time) and TRL's own buffers, and printed separately.

Usage:
    python benchmarks/grpo/memory_model.py                      # the stored variants, full shape
    python benchmarks/grpo/memory_model.py --variants rapidfire_lowmem3 --padded --breakdown
    python benchmarks/grpo/memory_model.py --rows 4 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from rapidfire_hf.utils.units import GIB, MIB


class LiveBytes(TorchDispatchMode):
    """Bytes of live storages on ``device`` created under this mode; peak per named phase."""

    def __init__(self, device: str = "meta", breakdown: bool = False):
        super().__init__()
        self.device = device
        self.live: dict[int, int] = {}
        self.now = 0
        self.phase = "other"
        self.peaks: dict[str, int] = {}
        self.breakdown = breakdown
        self.kind: dict[int, str] = {}  # storage -> "shape dtype" of the tensor that created it
        self.at_peak: dict[str, dict[str, int]] = {}  # phase -> what was live at its peak

    def ignore(self, tensors) -> None:
        """Storages that exist already (weights): views of them are not new memory."""
        for t in tensors:
            self.live[t.untyped_storage()._cdata] = 0

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.now)

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.now += n
        if self.breakdown:
            self.kind[key] = f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        if self.now > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.now
            if self.breakdown:
                snap: dict[str, int] = {}
                for k, b in self.live.items():
                    if b:
                        snap[self.kind.get(k, "?")] = snap.get(self.kind.get(k, "?"), 0) + b
                self.at_peak[self.phase] = snap

        def free(key=key, n=n):
            if self.live.pop(key, None) is not None:
                self.now -= n

        weakref.finalize(st, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


class _FlashSDPA(torch.autograd.Function):
    """What flash attention allocates (see module docstring), for q [B, Hq, S, D], k/v [B, Hkv, S, D]."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # noqa: F841
        softmax_d = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # noqa: F841
        dq = torch.empty_like(q)
        if k.shape[1] != q.shape[1]:  # GQA: dk, dv per query head, then summed over the group
            dk_full, dv_full = torch.empty_like(q), torch.empty_like(q)  # noqa: F841
        return dq, torch.empty_like(k), torch.empty_like(v)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # with a mask (padded rows) transformers has already repeated k/v to all heads (repeat_kv) and CUDA
    # runs the memory-efficient kernel, which saves and allocates about what the flash stand-in does
    return _FlashSDPA.apply(query, key, value)


@contextlib.contextmanager
def gpu_kernels_standins(padded: bool = False):
    import transformers.models.llama.modeling_llama as llama
    import trl.kernels.chunked_logprob as ck

    saved = (
        torch.nn.functional.scaled_dot_product_attention,
        ck._forward_tile,
        ck._backward_tile,
        ck._addmm_fp32,
    )
    saved_mask = llama.create_causal_mask
    torch.nn.functional.scaled_dot_product_attention = _sdpa
    ck._forward_tile = lambda *a, **k: None  # the Triton folds write in place, allocating nothing
    ck._backward_tile = lambda *a, **k: None
    # on CUDA (torch >= 2.8) the fp32 accumulation is one addmm with out_dtype into the accumulator; the
    # fallback elsewhere makes fp32 copies of both operands first
    ck._addmm_fp32 = lambda acc, a, b: None

    # unpadded rows: transformers hands SDPA no mask (is_causal, GQA inside the kernel); padded rows: a
    # [B, 1, S, S] bool mask (and k/v repeated to all heads). Its mask checks read data, which meta lacks.
    def causal_mask(*a, **k):
        if not padded:
            return None
        emb = k.get("inputs_embeds", a[1] if len(a) > 1 else None)
        b, n = emb.shape[:2]
        return torch.empty(b, 1, n, n, dtype=torch.bool, device=emb.device)

    llama.create_causal_mask = causal_mask
    is_autocast_enabled = torch.is_autocast_enabled
    torch.is_autocast_enabled = lambda *a: False if a and a[0] == "meta" else is_autocast_enabled(*a)
    try:
        yield
    finally:
        (
            torch.nn.functional.scaled_dot_product_attention,
            ck._forward_tile,
            ck._backward_tile,
            ck._addmm_fp32,
        ) = saved
        llama.create_causal_mask = saved_mask
        torch.is_autocast_enabled = is_autocast_enabled


def build_meta_model(shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidfire_hf.demo.shapes import config_kwargs

    config = LlamaConfig(**config_kwargs(shape), max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def static_bytes(model, optimizer: str) -> dict:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if optimizer == "adamw_torch_fused":
        state = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    elif optimizer in ("adamw_8bit", "adamw_8bit_all"):
        emb = set()
        if optimizer == "adamw_8bit":  # transformers' override: nn.Embedding state in 32 bits
            emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}

        def nbytes(p):
            if id(p) in emb or p.numel() < 4096:
                return 8 * p.numel()
            return 2 * p.numel() + 2 * 4 * -(-p.numel() // 256)  # two uint8 moments + fp32 absmax each

        state = sum(nbytes(p) for p in model.parameters())
    else:
        raise ValueError(optimizer)
    return {"weights": weights, "optimizer_state": state}


def grpo_step(
    model, shape: dict, tracker: LiveBytes, chunk_size: int, free_grads_mb: float | None, padded: bool = False
):
    """Loss forward and backward of TRL 1.16's GRPO loss (dapo, beta 0, on-policy) on ``model``."""
    from trl.kernels import ChunkedLogProbFunction

    b, p, c = shape["batch"], shape["prompt_len"], shape["completion_len"]
    ids = torch.zeros(b, p + c, dtype=torch.long, device="meta")
    if free_grads_mb is not None:
        pending: list[torch.Tensor] = []
        size = [0]

        def hook(param):
            pending.append(param)
            size[0] += param.numel() * param.element_size()
            if size[0] >= free_grads_mb * MIB:
                for q in pending:
                    q.grad = None
                pending.clear()
                size[0] = 0

        handles = [q.register_post_accumulate_grad_hook(hook) for q in model.parameters()]
    tracker.set_phase("loss_forward")
    with gpu_kernels_standins(padded):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        tokens = hidden[:, p - 1 :].reshape(-1, hidden.shape[-1])  # TRL gathers the valid positions
        labels = ids[:, p:].reshape(-1)
        logps, entropy, *_ = ChunkedLogProbFunction.apply(
            tokens,
            model.lm_head.weight,
            None,
            labels,
            1.0,
            chunk_size,
            None,
            1.0,
            ("log_probs", "entropy"),
        )
        logps, entropy = logps.view(b, c), entropy.view(b, c)
        adv = torch.zeros(b, 1, device="meta")
        coef_1 = torch.exp(logps - logps.detach())
        coef_2 = torch.clamp(coef_1, 0.8, 1.2)
        mask = torch.ones(b, c, device="meta")
        loss = (-torch.min(coef_1 * adv, coef_2 * adv) * mask).sum() / mask.sum()
        _ = (entropy.detach() * mask).sum() / mask.sum()  # TRL's entropy metric
        del hidden, tokens, logps, entropy, coef_1, coef_2
        tracker.set_phase("backward")
        loss.backward()
        tracker.set_phase("after_backward")
    if free_grads_mb is not None:
        for q in model.parameters():
            q.grad = None
        for h in handles:
            h.remove()
    grads = sum(q.grad.numel() * q.grad.element_size() for q in model.parameters() if q.grad is not None)
    model.zero_grad(set_to_none=True)
    return grads


def generation_bytes(shape: dict, prefill_rows: int | None = None) -> dict:
    """Static rollout engine: KV cache + noise buffer + the prefill's largest transient (estimate);
    ``prefill_rows``: the prefill runs that many prompts at a time (``RolloutEngine(prefill_chunk_rows=...)``)."""
    b, p, c, h = shape["batch"], shape["prompt_len"], shape["completion_len"], shape["hidden"]
    hd = h // shape["heads"]
    kv = shape["layers"] * 2 * b * shape["kv_heads"] * (p + c) * hd * 2
    noise = b * shape["vocab"] * 4
    t = min(b, prefill_rows or b) * p
    # prefill of one layer: MLP gate/up/act/product (4 x [t, I]) + residual stream and norm + q and the
    # repeated k/v of the whole prompt (sdpa on the prompt with a mask) + the fp32 norm intermediate
    prefill = 4 * t * shape["intermediate"] * 2 + 3 * t * h * 2 + t * h * 4 + 3 * t * h * 2
    return {"kv_cache": kv, "noise": noise, "prefill_transient": prefill}


VARIANTS = {
    # name: (checkpointing, optimizer, gradients freed by the pipeline, state on the host during rollout)
    "stock": ("hf_full", "adamw_torch_fused", False, False),
    "rapidfire_lowmem": ("hf_full", "adamw_8bit", False, False),  # every window deferred on the H200
    "rapidfire_lowmem2": ("chunked_offload", "adamw_8bit", True, True),
    "rapidfire_lowmem3": ("chunked_offload", "adamw_8bit_all", True, False),
}
# rapidfire_lowmem3's chunk sizes (memory.lowmem's LOWMEM_DEFAULTS in rapidfire_hf.integrations.lowmem)
LOWMEM3 = dict(rows=16, forward_rows=32, prefill_rows=16)


def estimate(
    variant: str,
    shape: dict,
    rows: int,
    lm_head_chunk: int,
    breakdown: bool = False,
    padded: bool = False,
    lowmem3: dict | None = None,
) -> dict:
    """``rows`` is ``rapidfire_lowmem2``'s; ``lowmem3`` overrides ``LOWMEM3`` for ``rapidfire_lowmem3``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # trl.trainer.utils before tracking: TRL's LM-head backward imports it on first use, and that import
    # (transformers -> peft -> bitsandbytes) allocates tensors the tracker would count in a first estimate
    import trl.trainer.utils  # noqa: F401

    from rapidfire_hf.memory.chunked_checkpoint import apply_chunked_checkpointing

    checkpointing, optimizer, pipeline, state_offload = VARIANTS[variant]
    v3 = dict(LOWMEM3, **(lowmem3 or {})) if variant == "rapidfire_lowmem3" else None
    model = build_meta_model(shape)
    if checkpointing == "hf_full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif v3 is not None:
        apply_chunked_checkpointing(model, rows=v3["rows"], forward_rows=v3["forward_rows"], offload=True)
    else:
        apply_chunked_checkpointing(model, rows=rows, offload=True)
    static = static_bytes(model, optimizer)
    tracker = LiveBytes(breakdown=breakdown)
    tracker.ignore([*model.parameters(), *model.buffers()])
    with tracker:
        grads = grpo_step(
            model,
            shape,
            tracker,
            lm_head_chunk if variant in ("rapidfire_lowmem2", "rapidfire_lowmem3") else 32768,
            64.0 if pipeline else None,
            padded,
        )
    gen = generation_bytes(shape, v3["prefill_rows"] if v3 else None)
    base = static["weights"] + static["optimizer_state"]
    phases = {k: v for k, v in tracker.peaks.items() if k != "other"}
    result = {
        "variant": variant,
        "chunking": v3 if v3 else ({"rows": rows} if checkpointing != "hf_full" else None),
        "rows": "padded (attention mask, k/v repeated)"
        if padded
        else "unpadded (no mask, GQA in the kernel)",
        "static_gib": {k: v / GIB for k, v in static.items()},
        "dynamic_peak_gib": {k: v / GIB for k, v in phases.items()},
        "total_peak_gib": {k: (base + v) / GIB for k, v in phases.items()},
        "gradients_left_after_backward_gib": grads / GIB,
        "generation_gib": {k: v / GIB for k, v in gen.items()},
        # the rollout of step 1 runs before any optimizer state exists; later ones with it, unless offloaded
        "generation_total_gib": ((static["weights"] if state_offload else base) + sum(gen.values())) / GIB,
    }
    if breakdown:
        result["live_at_phase_peak_mib"] = {
            phase: {k: round(v / MIB, 1) for k, v in sorted(snap.items(), key=lambda kv: -kv[1]) if v >= MIB}
            for phase, snap in tracker.at_peak.items()
        }
    result["estimated_peak_gib"] = max(max(result["total_peak_gib"].values()), result["generation_total_gib"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rows", type=int, default=8, help="rapidfire_lowmem2: sequences per chunk")
    parser.add_argument(
        "--padded", action="store_true", help="some completions ended early: attention mask, k/v repeated"
    )
    parser.add_argument("--lm-head-chunk", type=int, default=4096, help="lowmem2/3: TRL vocab tile")
    parser.add_argument("--lowmem3-rows", type=int, default=LOWMEM3["rows"], help="lowmem3: backward chunk")
    parser.add_argument(
        "--lowmem3-forward-rows", type=int, default=LOWMEM3["forward_rows"], help="lowmem3: forward chunk"
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=LOWMEM3["prefill_rows"], help="lowmem3: prompts per prefill chunk"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--breakdown", action="store_true", help="print what is live at each phase's peak")
    args = parser.parse_args(argv)
    shape = dict(
        hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000,
        prompt_len=128, completion_len=256, batch=args.batch,
    )  # fmt: skip
    v3 = dict(rows=args.lowmem3_rows, forward_rows=args.lowmem3_forward_rows, prefill_rows=args.prefill_rows)
    out = [
        estimate(v, shape, args.rows, args.lm_head_chunk, args.breakdown, args.padded, v3)
        for v in args.variants.split(",")
    ]
    for r in out:
        print(f"== {r['variant']} ({r['rows']}): estimated peak {r['estimated_peak_gib']:.2f} GiB")
        print("   static:", {k: round(v, 2) for k, v in r["static_gib"].items()})
        print("   training step, total by phase:", {k: round(v, 2) for k, v in r["total_peak_gib"].items()})
        print("   training step, above static:", {k: round(v, 2) for k, v in r["dynamic_peak_gib"].items()})
        print(
            "   generation:",
            round(r["generation_total_gib"], 2),
            {k: round(v, 2) for k, v in r["generation_gib"].items()},
        )
        for phase, snap in r.get("live_at_phase_peak_mib", {}).items():
            print(f"   live at the {phase} peak (MiB, by tensor shape):", snap)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
