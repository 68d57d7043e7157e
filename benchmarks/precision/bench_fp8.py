"""FP8 vs bf16: speed of the linear layers of the 1.1B and 7B Llama shapes, and a short training-loss run.

Speed (:func:`run_speed`): per shape, a stack of the shape's linears (q, k, v, o, gate, up, down) with an
RMS norm before each block and the element-wise glue between them (no attention kernel), so the time is
mostly that of what FP8 changes; 16 x 512 = 8,192 tokens; median forward+backward time of each variant:

* ``bf16`` (eager; the reference of the speed-ups and errors), ``bf16_compiled`` (each layer compiled:
  the fair reference of the compiled FP8 variants, whose norms and glue inductor also fuses);
* ``scaled_mm`` (our ``Float8Linear``, eager), ``scaled_mm_cached`` (FP8 weights kept between calls, as
  within a gradient-accumulation window), ``scaled_mm_compiled``;
* ``torchao_tensorwise`` / ``torchao_rowwise`` (``enable_fp8(backend="torchao", recipe=...)``), eager or
  ``_compiled`` (torchao's intended use: its casts fuse under ``torch.compile``).

FP8 layers are those ``enable_fp8`` selects (min(in, out) >= 1024: q, o, gate, up, down of the 1.1B; all
seven of the 7B). Without the norms the stack is not a model: the MLP is quadratic in its input and
activations overflow bf16 by layer 5. The 7B stack has 8 of its 32 layers by default (every layer is the
same, so the time per layer and the speed-up do not depend on the count; ``layers`` in the results).

Errors against ``bf16`` (same weights and input): ``output_rel_error`` (stack output), ``layer0_rel_error``
(first layer's output alone), ``grad_rel_error`` (first layer's ``down`` weight gradient).

Loss (:func:`run_loss`): a ``LlamaForCausalLM`` (1.1B shape by default) trained with AdamW for 40 steps of
8 x 512 tokens on a learnable token stream, once per variant, same seed, init and data: fp32 master weights
under bf16 autocast, or (``weights="bf16"``) bf16 weights, so that the 7B shape fits one H200. A
``_compiled`` variant compiles each decoder layer after the FP8 conversion (inductor on a GPU, backend
"eager" on CPU), so it is the end-to-end FP8 training step. Per variant: per-step losses and times, median
step ms (without the first, compiling, steps: their seconds are ``warmup_s``), tokens/s, peak GiB, speed-ups
vs eager and compiled bf16, loss differences to the reference (``bf16``, else ``bf16_compiled``).

Each variant runs in a ``try``: an error is recorded in its entry and the next one runs. A time budget
skips the variants left once it is spent (recorded as skipped).
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config, llama_shape
from rapidfire_hf.precision import convert_linears_to_fp8, enable_fp8, fp8_candidates, fp8_support
from rapidfire_hf.utils.imports import is_available

# name -> (FP8 backend or None for bf16, recipe, compiled, cached FP8 weights)
VARIANTS: dict[str, tuple[str | None, str | None, bool, bool]] = {
    "bf16": (None, None, False, False),
    "bf16_compiled": (None, None, True, False),
    "scaled_mm": ("scaled_mm", "tensorwise", False, False),
    "scaled_mm_cached": ("scaled_mm", "tensorwise", False, True),
    "scaled_mm_compiled": ("scaled_mm", "tensorwise", True, False),
    "torchao_tensorwise": ("torchao", "tensorwise", False, False),
    "torchao_tensorwise_compiled": ("torchao", "tensorwise", True, False),
    "torchao_rowwise": ("torchao", "rowwise", False, False),
    "torchao_rowwise_compiled": ("torchao", "rowwise", True, False),
}
SPEED_VARIANTS = (
    "bf16",
    "bf16_compiled",
    "scaled_mm",
    "scaled_mm_cached",
    "torchao_tensorwise_compiled",
    "torchao_rowwise_compiled",
)
LOSS_VARIANTS = ("bf16", "scaled_mm", "torchao_tensorwise", "torchao_rowwise")
SPEED_SHAPES = ("llama-1.1b", "llama-7b")
DEFAULT_LAYERS = {"llama-1.1b": 22, "llama-7b": 8}
TOKENS = 16 * 512
SMOKE_SPEED_SHAPE = dict(hidden=64, kv=16, mlp=128, layers=2, tokens=32)
SMOKE_MIN_FEATURES = 16  # the smoke shapes are tiny: convert every linear whose dims allow it


class Budget:
    """Wall-clock budget shared by the parts of one benchmark run (None: no limit)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.perf_counter()

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start > self.seconds

    def skipped(self) -> dict:
        return {"skipped": f"time budget of {self.seconds:.0f} s spent"}


def stack_shape(name: str, layers: int | None = None) -> dict:
    """The speed stack's shape for ``LLAMA_SHAPES[name]``: hidden, k/v width, MLP width, layers, tokens."""
    s = llama_shape(name)
    hidden, heads = s["hidden_size"], s["num_attention_heads"]
    return dict(
        hidden=hidden,
        kv=hidden // heads * s["num_key_value_heads"],
        mlp=s["intermediate_size"],
        layers=layers or DEFAULT_LAYERS.get(name, s["num_hidden_layers"]),
        layers_in_model=s["num_hidden_layers"],
        tokens=TOKENS,
    )


class _Layer(nn.Module):
    def __init__(self, hidden: int, kv: int, mlp: int):
        super().__init__()
        self.q, self.o = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.k, self.v = nn.Linear(hidden, kv, bias=False), nn.Linear(hidden, kv, bias=False)
        self.gate, self.up = nn.Linear(hidden, mlp, bias=False), nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x):
        h = F.rms_norm(x, x.shape[-1:])
        x = x + self.o(self.q(h)) + (self.k(h) * self.v(h)).mean(-1, keepdim=True)
        h = F.rms_norm(x, x.shape[-1:])
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _stack(shape: dict, device) -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device(device):
        layers = [_Layer(shape["hidden"], shape["kv"], shape["mlp"]) for _ in range(shape["layers"])]
        model = nn.Sequential(*layers).to(torch.bfloat16)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _time(model, x, iters: int, warmup: int) -> tuple[float, float, torch.Tensor]:
    """(median ms, first call's seconds (compilation included), last output); the last call's gradients
    stay on the parameters."""
    times, out, first_s = [], None, 0.0
    for i in range(warmup + iters):
        model.zero_grad(set_to_none=True)
        x.grad = None
        _sync(x.device)
        t0 = time.perf_counter()
        out = model(x)
        out.float().pow(2).mean().backward()
        _sync(x.device)
        dt = time.perf_counter() - t0
        if i == 0:
            first_s = dt
        if i >= warmup:
            times.append(dt * 1e3)
    return statistics.median(times), first_s, out.detach()


def _convert(model: nn.Module, variant: str, fp8_ok: bool, smoke: bool) -> list[str]:
    backend, recipe, _, cache = VARIANTS[variant]
    if backend is None:
        return []
    if fp8_ok:
        return enable_fp8(model, backend=backend, recipe=recipe, cache_weights=cache)
    # CPU smoke: the FP8 layers run there too (slowly); enable_fp8 refuses a CPU model
    names = fp8_candidates(model, min_features=SMOKE_MIN_FEATURES if smoke else 1024)
    return convert_linears_to_fp8(model, names, backend=backend, recipe=recipe, cache_weights=cache)


def _compile(layers, smoke: bool) -> None:
    # one compiled region per layer (the layers share the compiled code: one compilation per variant);
    # the CPU smoke only traces (backend "eager"), inductor's C++ build would take minutes there
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(backend="eager" if smoke else "inductor")


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def unavailable(variant: str, fp8_ok: bool, why: str, smoke: bool) -> str | None:
    """Why ``variant`` cannot run here (None: it can)."""
    backend = VARIANTS[variant][0]
    if backend is None:
        return None
    if not fp8_ok and not smoke:
        return why
    if backend == "torchao" and not is_available("torchao"):
        return "torchao is not installed (pip install 'rapidfire_hf[fp8]')"
    return None


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _speed_variant(variant, shape, x, ref, fp8_ok, smoke, iters, warmup, device) -> dict:
    _, _, compiled, _ = VARIANTS[variant]
    model = _stack(shape, device)  # same seed: the same weights in every variant
    layers = list(model)
    grad_param = layers[0].down.weight  # the Parameter survives the conversion
    entry = {"fp8_layers": len(_convert(model, variant, fp8_ok, smoke)), "compiled": compiled}
    if compiled:
        _compile(layers, smoke)
        warmup = max(warmup, 3)
        graphs = _unique_graphs()
    entry["ms"], entry["first_call_s"], out = _time(model, x, iters, warmup)
    entry["output_finite"] = bool(torch.isfinite(out).all())
    grad = grad_param.grad.detach().clone()
    layer0 = layers[0](x).detach()  # grad mode and input as in training: a compiled layer is not recompiled
    if ref is not None:
        entry["output_rel_error"] = _rel_error(out, ref["out"])
        entry["layer0_rel_error"] = _rel_error(layer0, ref["layer0"])
        entry["grad_rel_error"] = _rel_error(grad, ref["grad"])
    entry["_ref"] = {"out": out, "layer0": layer0, "grad": grad}
    if compiled:
        entry["compiled_graphs"] = _unique_graphs() - graphs  # 1 (or a few, with graph breaks) expected
        torch._dynamo.reset()
    return entry


def run_speed(
    smoke: bool,
    device: torch.device,
    shapes=SPEED_SHAPES,
    variants=SPEED_VARIANTS,
    layers: int | None = None,
    budget: Budget | None = None,
) -> dict:
    """Median ms per forward+backward of each variant on each shape, with speed-ups and errors vs bf16."""
    budget = budget or Budget(None)
    variants = ["bf16"] + [v for v in variants if v != "bf16"]  # the reference first
    fp8_ok, why = fp8_support(device)
    iters, warmup = (1, 0) if smoke else (20, 5)
    result = {
        "fp8_available": fp8_ok,
        "fp8_unavailable_reason": why or None,
        "tokens": SMOKE_SPEED_SHAPE["tokens"] if smoke else TOKENS,
        "iters": iters,
        "warmup": warmup,
        "shapes": {},
    }
    for name in shapes:
        shape = dict(SMOKE_SPEED_SHAPE) if smoke else stack_shape(name, layers)
        out = {"shape": shape, "variants": {}}
        result["shapes"][name] = out
        # requires grad, like the input of every later layer: one compiled graph serves all the layers
        x = torch.randn(
            shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16
        ).requires_grad_()
        ref = None
        for variant in variants:
            if budget.spent():
                out["variants"][variant] = budget.skipped()
                continue
            reason = unavailable(variant, fp8_ok, why, smoke)
            if reason:
                out["variants"][variant] = {"skipped": reason}
                continue
            t0 = time.perf_counter()
            _reset_peak(device)
            try:
                entry = _speed_variant(variant, shape, x, ref, fp8_ok, smoke, iters, warmup, device)
            except Exception as e:  # recorded; the other variants still run
                entry = {"error": f"{type(e).__name__}: {e}"[:600]}
                torch._dynamo.reset()
            entry["seconds"] = time.perf_counter() - t0
            entry["peak_gib"] = _peak_gib(device)
            if variant == "bf16" and "_ref" in entry:
                ref = entry["_ref"]
            entry.pop("_ref", None)
            out["variants"][variant] = entry
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"fp8 speed {name:11s} {variant:28s} {_brief(entry)}", flush=True)
        base = out["variants"].get("bf16", {}).get("ms")
        base_c = out["variants"].get("bf16_compiled", {}).get("ms")
        for entry in out["variants"].values():
            if "ms" in entry and base:
                entry["speedup_vs_bf16"] = base / entry["ms"]
                if entry["compiled"] and base_c:
                    entry["speedup_vs_bf16_compiled"] = base_c / entry["ms"]
    return result


def _brief(entry: dict) -> str:
    if "ms" not in entry:
        return entry.get("error") or entry.get("skipped", "")
    err = entry.get("output_rel_error")
    return f"{entry['ms']:8.2f} ms" + (f"  rel err {err:.4f}" if err is not None else "")


# -- the training-loss comparison ---------------------------------------------------------------------------

LOSS_WEIGHTS = ("fp32", "bf16")  # fp32 master weights under bf16 autocast, or pure bf16 (7B fits one H200)
LOSS_DEFAULTS = dict(batch=8, seq=512, lr=3e-4)
SMOKE_LOSS_DEFAULTS = dict(batch=2, seq=32, lr=1e-3)
# steps left out of the median step time: the first eager step (allocator, cuBLAS heuristics); the first
# compiled ones (step 1 compiles the forward and the backward; 3 leaves room for a late recompilation)
EAGER_WARMUP_STEPS, COMPILED_WARMUP_STEPS = 1, 3


def _token_batches(steps: int, batch: int, seq: int, vocab: int, device, seed: int = 1):
    """A learnable stream: each sequence counts up by a random stride from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(4, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        yield (4 + (start + stride * torch.arange(seq)) % (vocab - 4)).to(device)


def loss_plan(variants) -> tuple[list[str], str]:
    """The loss run's variants in running order, and the reference of its loss differences.

    The bf16 variants the speed-ups need are added: ``bf16`` when an eager FP8 variant is asked for (or no
    bf16 variant at all), ``bf16_compiled`` when a compiled FP8 one is. They run first. The reference of
    the loss differences is ``bf16`` when it runs, else ``bf16_compiled``.
    """
    variants = list(dict.fromkeys(variants))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown or no loss variants {unknown or variants}; known: {', '.join(VARIANTS)}")
    fp8 = [v for v in variants if VARIANTS[v][0] is not None]
    wanted = set(variants)
    if any(VARIANTS[v][2] for v in fp8):
        wanted.add("bf16_compiled")
    if any(not VARIANTS[v][2] for v in fp8) or not wanted & {"bf16", "bf16_compiled"}:
        wanted.add("bf16")
    refs = [v for v in ("bf16", "bf16_compiled") if v in wanted]
    return refs + [v for v in variants if v not in refs], refs[0]


def _to_bf16(model: nn.Module) -> None:
    """Parameters to bf16 in place (same init as the fp32 run, rounded); buffers such as RoPE's inv_freq stay
    fp32, as in a model loaded with ``dtype=torch.bfloat16``."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)


def _loss_variant(variant, shape_name, steps, batch, seq, lr, weights, fp8_ok, smoke, device) -> dict:
    from transformers import LlamaForCausalLM

    compiled = VARIANTS[variant][2]
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(llama_shape(shape_name), max_position_embeddings=seq))
    if weights == "bf16":
        _to_bf16(model)
    names = _convert(model, variant, fp8_ok, smoke)
    entry = {
        "fp8_layers": len(names),
        "compiled": compiled,
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    if compiled:  # after the FP8 conversion, one region per decoder layer (all share one compiled graph)
        backend = "eager" if smoke or device.type != "cuda" else "inductor"
        entry["compile_backend"] = backend
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(backend=backend)
        graphs = _unique_graphs()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    losses, times = [], []
    vocab = model.config.vocab_size
    _reset_peak(device)  # the training peak: weights, gradients, AdamW state, activations
    for ids in _token_batches(steps, batch, seq, vocab, device):
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):  # a no-op on the matmuls of bf16 weights
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        _sync(device)
        times.append(time.perf_counter() - t0)
    skip = min(COMPILED_WARMUP_STEPS if compiled else EAGER_WARMUP_STEPS, steps - 1)
    median_ms = statistics.median(times[skip:]) * 1e3
    entry.update(
        loss=losses,
        final_loss_mean_last5=statistics.fmean(losses[-5:]),
        nonfinite_steps=sum(not math.isfinite(v) for v in losses),
        step_ms=[t * 1e3 for t in times],
        warmup_steps=skip,
        warmup_s=sum(times[:skip]),  # compilation included
        first_step_s=times[0],
        median_step_ms=median_ms,
        tokens_per_s=batch * seq / (median_ms / 1e3),
        peak_gib=_peak_gib(device),
    )
    if compiled:
        entry["compiled_graphs"] = _unique_graphs() - graphs  # 1 expected: one graph for every layer
        torch._dynamo.reset()
    return entry


def run_loss(
    smoke: bool,
    device: torch.device,
    variants=LOSS_VARIANTS,
    steps: int | None = None,
    shape_name: str | None = None,
    budget: Budget | None = None,
    weights: str = "fp32",
    batch: int | None = None,
    seq: int | None = None,
    lr: float | None = None,
    progress=None,
) -> dict:
    """Per-step training losses, step times and throughput of each variant (same seed, init and data);
    loss differences to the reference (``bf16``, else ``bf16_compiled``), speed-ups to eager and compiled
    bf16. ``weights``: ``"fp32"`` master weights under bf16 autocast, or ``"bf16"`` (pure bf16 training).
    ``progress(result)`` is called after each variant with the result so far (to save it).
    """
    budget = budget or Budget(None)
    if weights not in LOSS_WEIGHTS:
        raise ValueError(f"loss weights must be one of {', '.join(LOSS_WEIGHTS)}, got {weights!r}")
    variants, reference = loss_plan(variants)
    fp8_ok, why = fp8_support(device)
    shape_name = shape_name or ("smoke" if smoke else "llama-1.1b")
    if shape_name not in LLAMA_SHAPES:
        raise ValueError(f"unknown loss shape {shape_name!r}; known: {', '.join(LLAMA_SHAPES)}")
    defaults = SMOKE_LOSS_DEFAULTS if smoke else LOSS_DEFAULTS
    steps = steps or (4 if smoke else 40)
    batch, seq, lr = batch or defaults["batch"], seq or defaults["seq"], lr or defaults["lr"]
    for what, value in (("steps", steps), ("batch", batch), ("seq", seq), ("lr", lr)):
        if value <= 0:
            raise ValueError(f"loss {what} must be positive, got {value}")
    master = (
        "fp32 master weights, bf16 autocast"
        if weights == "fp32"
        else "bf16 weights (pure bf16 training; autocast on, a no-op on its matmuls)"
    )
    result = {
        "shape": shape_name,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "tokens_per_step": batch * seq,
        "lr": lr,
        "weights": weights,
        "setup": f"LlamaForCausalLM, {master}, AdamW (warm-up over steps/8, grad-norm clip 1.0), a stream "
        "counting up by a random stride (mod vocab); same seed and data; _compiled: each decoder layer "
        "compiled after the FP8 conversion",
        "reference": reference,
        "reference_note": f"*_vs_reference loss differences are against {reference} (bf16 when it runs, else "
        "bf16_compiled); speedup_vs_bf16 is against eager bf16, speedup_vs_bf16_compiled against "
        "bf16_compiled; median_step_ms leaves out the first warmup_steps steps (warmup_s: their "
        "seconds, compilation included)",
        "fp8_available": fp8_ok,
        "fp8_unavailable_reason": why or None,
        "variants": {},
    }
    for variant in variants:
        reason = budget.skipped()["skipped"] if budget.spent() else unavailable(variant, fp8_ok, why, smoke)
        if reason:
            result["variants"][variant] = {"skipped": reason}
            print(f"fp8 loss  {shape_name} {variant:28s} skipped: {reason}", flush=True)
            continue
        t0 = time.perf_counter()
        _reset_peak(device)
        try:
            entry = _loss_variant(variant, shape_name, steps, batch, seq, lr, weights, fp8_ok, smoke, device)
        except Exception as e:  # recorded (an OOM too); the other variants still run
            entry = {"error": f"{type(e).__name__}: {e}"[:600], "peak_gib": _peak_gib(device)}
            torch._dynamo.reset()
        entry["seconds"] = time.perf_counter() - t0
        result["variants"][variant] = entry
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"fp8 loss  {shape_name} {variant:28s} {_loss_brief(entry)}", flush=True)
        _compare(result)
        if progress is not None:
            progress(result)
    for variant, entry in result["variants"].items():
        if "speedup_vs_bf16" in entry or "speedup_vs_bf16_compiled" in entry:
            ups = {k.removeprefix("speedup_vs_"): v for k, v in entry.items() if k.startswith("speedup_vs_")}
            print(
                f"fp8 loss  {shape_name} {variant:28s} speed-up "
                + ", ".join(f"{v:.2f}x vs {k}" for k, v in ups.items()),
                flush=True,
            )
    return result


def _compare(result: dict) -> None:
    """Loss differences to the reference and speed-ups to eager / compiled bf16, into each variant's entry."""
    runs = result["variants"]
    ref_name = result["reference"]
    ref = runs.get(ref_name, {}).get("loss")
    base = runs.get("bf16", {}).get("median_step_ms")
    base_c = runs.get("bf16_compiled", {}).get("median_step_ms")
    for entry in runs.values():
        if "loss" not in entry:
            continue
        if ref:
            diffs = [abs(a - b) for a, b in zip(entry["loss"], ref)]
            diff = {
                "max_abs_diff": max(diffs),
                "mean_abs_diff": statistics.fmean(diffs),
                "final_diff": entry["final_loss_mean_last5"] - statistics.fmean(ref[-5:]),
            }
            for key, value in diff.items():
                entry[f"{key}_vs_reference"] = value
                if ref_name == "bf16":  # the keys of the earlier (eager-only) results
                    entry[f"{key}_vs_bf16"] = value
        if base:
            entry["speedup_vs_bf16"] = base / entry["median_step_ms"]
        if entry["compiled"] and base_c:
            entry["speedup_vs_bf16_compiled"] = base_c / entry["median_step_ms"]


def _loss_brief(entry: dict) -> str:
    if "loss" not in entry:
        return entry.get("error") or entry.get("skipped", "")
    peak = entry["peak_gib"]
    text = (
        f"final {entry['final_loss_mean_last5']:.4f}  {entry['median_step_ms']:.1f} ms/step  "
        f"{entry['tokens_per_s']:,.0f} tok/s  warm-up {entry['warmup_s']:.1f} s"
    )
    return text + (f"  peak {peak:.1f} GiB" if peak is not None else "")
