"""Where the rollout's decode step spends its time (issue 31, item 1), under ``torch.profiler``.

For each model shape (1.1B and 7B Llama, random weights), batch and kernel variant (``default``: SDPA
attention and the PyTorch sampler; ``triton``: ``decode_attention="triton"``, ``decode_sampler="triton"``)
the script builds the decode step as ``benchmarks/rollout/run.py`` does (``RolloutEngine(backend="static")``,
128-token prompts, a 384-token response buffer, so the cache holds 512 slots; ``--mode compile`` is the
engine's default on CUDA), then:

1. runs a warm-up call up to step ``--first-step + --steps`` (compiles and records the step's CUDA graph);
2. times steps ``first-step+1 .. first-step+steps`` of a second call, without the profiler and with one
   device sync at each end: ``wall_ms`` per step, as the rollout benchmark measures it;
3. runs a third call under ``torch.profiler`` with a marker kernel after step ``first-step`` and after the
   last step, and sums the GPU time of every kernel (and memcpy / memset) between the two markers.

Each kernel is put in one of :data:`CATEGORIES` by its name (:func:`classify_kernel`). Per step the row gives
the milliseconds of each category, their sum (``kernel_ms``), the launch gaps ``gap_ms = wall_ms - kernel_ms``
(time the GPU waits between kernels: host launch cost, graph launch, syncs), the GPU busy time (union of the
kernels' intervals) and the ten costliest kernels. The bandwidth floor is the bytes a step must read, the
weights (all but the input embedding, of which only B rows are read) plus the K/V cache slots attention reads,
over the GPU's peak bandwidth (4.8 TB/s on the H200).

Rows are appended to results.json / results.csv as each cell finishes (a killed run keeps them); the
chart (profile.png) stacks the categories and the gaps per cell, with the floor marked.

    python benchmarks/kernels/profile_decode.py --out OUT                  # one H200, compiled: ~25 s a cell
    python benchmarks/kernels/profile_decode.py --out OUT --mode cuda_graph  # recorded, uncompiled: faster
    python benchmarks/kernels/profile_decode.py --out OUT --smoke          # CPU: tiny model, CPU op names
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    LLAMA_SHAPES,
    cuda_or_smoke,
    environment,
    llama_shape,
    save_figure,
    write_csv,
    write_json,
)
from benchmarks.common.charts import pyplot  # noqa: E402

CATEGORIES = ("gemm", "attention", "norm_rope_elementwise", "sampling", "other")
# "<name>": (decode_attention, decode_sampler) of the engine
VARIANTS = {
    "default": ("auto", "torch"),  # the engine's defaults (SDPA attention before 2026-12-04; call5 ran that)
    "sdpa": ("sdpa", "torch"),
    "triton": ("triton", "triton"),
    "triton-philox": ("triton", "triton-philox"),
    "fuse": ("sdpa", "torch"),  # + decode_fuse_projections (FUSED below)
    "tattn": ("triton", "torch"),  # the flash-decoding kernel alone (bounded by the step's slot)
    "fuse_tattn": ("triton", "torch"),  # both
    "int8": ("auto", "torch"),  # the defaults with the KV cache in int8 (INT8 below)
}
FUSED = ("fuse", "fuse_tattn")
INT8 = ("int8",)  # kv_cache_dtype="int8": what PPOTrainer's "auto" chooses for 7B LoRA batch 256
SHAPES = {"llama-1.1b": LLAMA_SHAPES["llama-1.1b"], "llama-7b": LLAMA_SHAPES["llama-7b"]}
SMOKE_SHAPES = {"smoke": llama_shape("smoke", vocab_size=128)}
PEAK_TB_S = {"H200": 4.8, "H100": 3.35}  # HBM peak (vendor figures), as benchmarks/kernels/run.py
DEFAULT_TB_S = 4.8  # the H200's, used where the GPU is not in the table (and in the CPU smoke run)

# The project's own Triton kernels (kernels/triton_flash_decode.py, kernels/triton_sampling.py) by the names
# of their @triton.jit functions, which are the names the profiler shows; a test checks they still exist.
PROJECT_KERNELS = {"_partial_kernel": "attention", "_merge_kernel": "attention", "_sample_kernel": "sampling"}
ATTENTION = ("flash", "fmha", "attention", "sdpa", "splitkv", "mha_")
# softmax counts as sampling: with SDPA or the Triton kernel the step's only softmax is over the vocabulary
# (with decode_attention="matmul" attention's softmax would land here too, and its bmm in gemm)
SAMPLING = (
    "softmax",
    "argmax",
    "logsumexp",
    "multinomial",
    "distribution",
    "uniform",
    "philox",
    "gumbel",
    "topk",
    "_sample",
)
GEMM = (
    "gemm",
    "gemv",
    "nvjet",
    "xmma",
    "cutlass",
    "cublas",
    "splitk",
    "wgmma",
    "s16816",
    "dot_kernel",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "triton_tem_fused",
    "triton_mm",
)
ELEMENTWISE = (
    "elementwise",
    "rms",
    "norm",
    "rsqrt",
    "rotary",
    "rope",
    "silu",
    "act_and_mul",
    "reduce_kernel",
    "index",
    "copy",
    "cat",
    "fill",
    "triton_poi_",
    "triton_per_",
    "triton_red_",
)
# op names inductor puts in a fused kernel's name that only the sampling tail of the step has: the Gumbel
# noise's log, the vocabulary softmax / argmax and the gather of the drawn token's log-prob
INDUCTOR_SAMPLING_OPS = {
    "log",
    "softmax",
    "argmax",
    "logsumexp",
    "gather",
    "exponential",
    "multinomial",
    "uniform",
}
# CPU op names (the smoke run's profile has no kernels): elementwise aten ops
CPU_ELEMENTWISE_OPS = {
    "add",
    "add_",
    "mul",
    "mul_",
    "neg",
    "pow",
    "mean",
    "rsqrt",
    "silu",
    "cat",
    "where",
    "div",
    "sub",
    "exp",
    "to",
    "_to_copy",
    "copy_",
    "index_select",
    "index_copy_",
    "index_fill_",
    "embedding",
    "fill_",
    "clone",
    "eq",
    "any",
    "lt",
    "squeeze",
    "unsqueeze",
}
PROMPT_BUCKET = 32  # the static engine's default prompt_bucket: prompts are left-padded to a multiple of it
GPU_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: one after step first-step, one after the last
CPU_MARKER = "rapidfire_profile_marker"  # a record_function range (the CPU smoke run)


def classify_kernel(name: str) -> str:
    """The category (one of :data:`CATEGORIES`) of a GPU kernel, memcpy / memset, or CPU op, by its name.

    Order matters: attention before GEMM (flash-attention and ``fmha_cutlassF`` names mention cutlass),
    sampling before elementwise (``reduce_kernel<...ArgMaxOps>`` is a reduction). Inductor's fused kernels
    (``triton_{poi,per,red}_fused_<ops>_<n>``) go to sampling when their ops include one of
    :data:`INDUCTOR_SAMPLING_OPS`, else to norm / rope / elementwise.
    """
    for kernel, category in PROJECT_KERNELS.items():
        if kernel in name:
            return category
    low = name.lower()
    inductor = re.match(r"triton_(poi|per|red)_fused_(.*?)(_\d+)?$", name)
    if inductor:
        ops = set(inductor.group(2).split("_"))
        return "sampling" if ops & INDUCTOR_SAMPLING_OPS else "norm_rope_elementwise"
    for patterns, category in ((ATTENTION, "attention"), (SAMPLING, "sampling"), (GEMM, "gemm")):
        if any(p in low for p in patterns):
            return category
    if low.startswith("aten::") and low.removeprefix("aten::") in CPU_ELEMENTWISE_OPS:
        return "norm_rope_elementwise"
    if any(p in low for p in ELEMENTWISE) and not low.startswith(("memcpy", "memset")):
        return "norm_rope_elementwise"
    return "other"


def self_times(events: list[dict]) -> list[dict]:
    """Nested events (``name``, ``ts``, ``dur``, one thread) with ``dur`` replaced by the self time, less
    the direct children's: ``aten::mm``'s work counts as ``aten::mm``, not as the ``aten::linear`` around it,
    and the durations add up to the time covered by the outermost events."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    own = [e["dur"] for e in ordered]
    stack: list[int] = []
    for i, e in enumerate(ordered):
        while stack and ordered[stack[-1]]["ts"] + ordered[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= e["dur"]
        stack.append(i)
    return [{**e, "dur": max(d, 0.0)} for e, d in zip(ordered, own)]


def trace_events(trace: dict, cuda: bool) -> list[dict]:
    """``{name, ts, dur}`` (microseconds) of a Chrome trace from ``torch.profiler``: the device's kernels,
    memcpys and memsets on CUDA; on the CPU the ops of the thread that ran the marker, by self time."""
    rows = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if cuda:
        keep = ("kernel", "gpu_memcpy", "gpu_memset")
        return [
            {"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])}
            for e in rows
            if e.get("cat") in keep
        ]
    marker_tids = {e.get("tid") for e in rows if e["name"] == CPU_MARKER}
    cpu = [
        e
        for e in rows
        if e.get("cat", "").lower() in ("cpu_op", "user_annotation") and e.get("tid") in marker_tids
    ]
    return self_times([{"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in cpu])


def step_window(events: list[dict], marker: str) -> tuple[list[dict], float | None]:
    """The events after the first ``marker`` event ends and before the last one starts, and that span in
    microseconds. Without two markers, all the non-marker events and ``None``."""
    marks = sorted((e for e in events if marker in e["name"]), key=lambda e: e["ts"])
    rest = [e for e in events if marker not in e["name"]]
    if len(marks) < 2:
        return rest, None
    start, end = marks[0]["ts"] + marks[0]["dur"], marks[-1]["ts"]
    return [e for e in rest if e["ts"] >= start and e["ts"] + e["dur"] <= end], end - start


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one event runs (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        s, f = e["ts"], e["ts"] + e["dur"]
        if f > end:
            total += f - max(s, end)
            end = f
    return total


def breakdown(events: list[dict], steps: int, wall_ms: float | None, top: int = 10) -> dict:
    """Per-step milliseconds of each category, their sum, the launch gaps and the costliest kernels.

    Args:
        events: ``{name, ts, dur}`` in microseconds, the kernels of ``steps`` decode steps.
        steps: decode steps the events cover.
        wall_ms: the step's wall time measured without the profiler (None: no gap).
        top: how many kernels (by time) to list.
    """
    ms = dict.fromkeys(CATEGORIES, 0.0)
    per_name: dict[str, list] = {}
    for e in events:
        cat = classify_kernel(e["name"])
        ms[cat] += e["dur"] / 1e3 / steps
        entry = per_name.setdefault(e["name"], [cat, 0, 0.0])
        entry[1] += 1
        entry[2] += e["dur"] / steps
    kernel_ms = sum(ms.values())
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        **{f"{c}_ms": v for c, v in ms.items()},
        "kernel_ms": kernel_ms,
        "busy_ms": busy_us(events) / 1e3 / steps,
        "gap_ms": None if wall_ms is None else wall_ms - kernel_ms,
        "kernels_per_step": len(events) / steps,
        "top_kernels": [
            {"name": name[:160], "category": cat, "calls_per_step": n / steps, "us_per_step": us}
            for name, (cat, n, us) in ranked
        ],
    }


def weight_read_bytes(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter, except that of an untied input embedding
    only the ``batch`` looked-up rows."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def kv_read_bytes(shape: dict, batch: int, slots: float, element_size: int) -> float:
    """Bytes of K and V that one decode step's attention reads: every layer, ``slots`` cache slots a row."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_slot = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * element_size
    return per_slot * batch * slots


def floor_ms(nbytes: float, tb_s: float) -> float:
    """Milliseconds to read ``nbytes`` once at ``tb_s`` terabytes per second."""
    return nbytes / (tb_s * 1e12) * 1e3


def kv_slots_read(mode: str, prompt: int, response: int, steps: range) -> float:
    """Mean cache slots attention reads over ``steps`` (the static engine's ``_kv_len``): the whole cache
    when compiled, else the filled slots rounded up to a multiple of ``KV_BUCKET``."""
    from rapidfire_hf.rollout.static_engine import KV_BUCKET

    if mode == "compile":
        return float(prompt + response)
    return sum(min(prompt + response, -(-(prompt + t) // KV_BUCKET) * KV_BUCKET) for t in steps) / len(steps)


def llama_weight_bytes(shape: dict, batch: int, element_size: int) -> int:
    """:func:`weight_read_bytes` of an untied Llama of ``shape`` from its config alone (so a skipped cell
    still gets its floor): per layer q/o (H x H), k/v (H x KV*D), the MLP (3 x H x I), two norms; the final
    norm, the LM head, and ``batch`` rows of the input embedding."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return (shape["num_hidden_layers"] * layer + h + v * h + batch * h) * element_size


def estimate_gib(shape: dict, batch: int, prompt: int, response: int, element_size: int) -> float:
    """Rough peak memory of one cell: all weights, the whole cache, the noise buffers and one prefill
    layer's activations (q/k/v, MLP, twice over) for all prompts at once."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    weights = llama_weight_bytes(shape, 0, element_size) + v * h * element_size
    cache = kv_read_bytes(shape, batch, prompt + response, element_size)
    prefill = batch * prompt * (6 * h + 3 * i) * element_size * 2
    return (weights + cache + 2 * batch * v * 4 + prefill) / 2**30


class _Stop(Exception):
    """Raised by the step callback to end a generate call after the last profiled step."""


def _run_until(engine, ids, mask, params, last: int, on_step=None) -> None:
    """One ``generate`` call of ``engine`` that stops after decode step ``last`` (buffers and graphs stay)."""

    def callback(t):
        if on_step is not None:
            on_step(t)
        if t >= last:
            raise _Stop

    engine._static.step_callback = callback
    try:
        engine.generate(ids, mask, params)
    except _Stop:
        pass
    finally:
        engine._static.step_callback = None


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _marker(cuda: bool) -> None:
    if cuda:
        torch.cuda._sleep(1)  # a one-cycle kernel: a mark on the GPU's timeline, in stream order
    else:
        with torch.profiler.record_function(CPU_MARKER):
            pass


def profile_cell(model, shape: dict, variant: str, batch: int, args, cuda: bool) -> dict:
    """Warm up, time and profile one (shape, variant, batch) cell; the row's numbers (see the module doc)."""
    from rapidfire_hf.rollout import RolloutEngine, SamplingParams

    attention, sampler = VARIANTS[variant]
    engine = RolloutEngine(
        model,
        pad_token_id=0,
        stop_token_ids=[],
        backend="static",
        decode_mode=args.mode,
        decode_attention=attention,
        decode_sampler=sampler,
        decode_fuse_projections=variant in FUSED,
        kv_cache_dtype="int8" if variant in INT8 else None,
    )
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, shape["vocab_size"], (batch, args.prompt_len), generator=g).to(model.device)
    mask = torch.ones_like(ids)
    params = SamplingParams(args.new_tokens, temperature=1.0)
    first, last = args.first_step, args.first_step + args.steps
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        _run_until(engine, ids, mask, params, last)  # compile / record
        _sync(cuda)
        warmup_s = time.perf_counter() - t0
        marks = {}

        def stamp(t):
            if t in (first, last):
                _sync(cuda)
                marks[t] = time.perf_counter()

        _run_until(engine, ids, mask, params, last, stamp)
        wall_ms = (marks[last] - marks[first]) * 1e3 / args.steps
        activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            _run_until(
                engine, ids, mask, params, last, lambda t: _marker(cuda) if t in (first, last) else None
            )
            _sync(cuda)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = json.loads(Path(f"{tmp}/trace.json").read_text())
        window, span_us = step_window(trace_events(trace, cuda), GPU_MARKER if cuda else CPU_MARKER)
        row = {"status": "ok", "wall_ms": wall_ms, "warmup_s": warmup_s}
        row["window"] = "between markers" if span_us is not None else "whole call (markers not found)"
        steps = args.steps if span_us is not None else last  # without markers: all steps of the call
        row["span_ms"] = span_us / 1e3 / steps if span_us is not None else None
        row.update(breakdown(window, steps, wall_ms if span_us is not None else None))
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return row
    finally:
        engine.release()
        del engine
        # every cell compiles the engine's step method anew; without a reset dynamo counts them all
        # against its recompile limit (8) and runs the later cells uncompiled (call5's batch-64 cells)
        torch._dynamo.reset()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def build_model(shape: dict, device: str, dtype: torch.dtype, max_positions: int):
    """Random-init ``LlamaForCausalLM`` of ``shape``, built on ``device`` in ``dtype`` (as benchmarks/rollout)."""
    from transformers import LlamaForCausalLM

    from rapidfire_hf.demo.shapes import llama_config

    config = llama_config({**shape}, max_positions, tie_word_embeddings=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a 7B model initialised in fp32 first would need 27 GB more
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model.generation_config.eos_token_id = None  # no stop token: every row runs every step
    return model.to(dtype).eval()


def cells(shapes: list[str], batches: list[int], variants: list[str]) -> list[tuple[str, int, str]]:
    """Cells in priority order (a cell not started within the budget is skipped): the smallest batch of
    every shape first, so a short call still covers both models."""
    return [(s, b, v) for b in batches for s in shapes for v in variants]


def write_results(out: Path, env: dict, rows: list[dict]) -> None:
    write_json(out / "results.json", {"environment": env, "rows": rows})
    fields = [
        "shape",
        "batch",
        "variant",
        "mode",
        "status",
        *[f"{c}_ms" for c in CATEGORIES],
        "kernel_ms",
        "gap_ms",
        "wall_ms",
        "span_ms",
        "busy_ms",
        "floor_ms",
        "x_floor",
        "weight_bytes",
        "kv_bytes",
        "kv_slots",
        "kernels_per_step",
        "peak_gib",
    ]
    write_csv(out / "results.csv", rows, fields)
    chart(out / "profile.png", env, rows)


def chart(path: Path, env: dict, rows: list[dict]) -> None:
    """Stacked horizontal bars: categories and launch gaps per cell, the floor as a black tick."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(ok) + 1.8))
    parts = [f"{c}_ms" for c in CATEGORIES] + ["gap_ms"]
    for y, r in enumerate(ok):
        left = 0.0
        for i, key in enumerate(parts):
            width = max(r.get(key) or 0.0, 0.0)
            ax.barh(y, width, left=left, color=f"C{i}", label=key.removesuffix("_ms") if y == 0 else None)
            left += width
        ax.plot(
            [r["floor_ms"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2, label="floor" if y == 0 else None
        )
    ax.set_yticks(range(len(ok)), [f"{r['shape']} b{r['batch']} {r['variant']}" for r in ok], fontsize=8)
    ax.set_xlabel("milliseconds per decode step")
    ax.set_title(
        f"decode step by kernel category, {env.get('gpu') or 'cpu (smoke)'}, mode {ok[0]['mode']}",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="8,64,256")
    p.add_argument("--variants", default="default,triton", help=f"subset of {','.join(VARIANTS)}")
    p.add_argument(
        "--mode", default="compile", choices=("compile", "cuda_graph"), help="the engine's decode_mode"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--new-tokens", type=int, default=384, help="response buffer: the cache holds prompt + this"
    )
    p.add_argument("--first-step", type=int, default=8, help="profile the steps after this one")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed and profiled")
    p.add_argument(
        "--budget-s", type=float, default=1e9, help="cells not started within this many s are skipped"
    )
    p.add_argument(
        "--memory-gib", type=float, default=None, help="skip cells estimated above (default: free)"
    )
    p.add_argument(
        "--peak-tb-s", type=float, default=None, help="bandwidth of the floor (default: by GPU name)"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager step, CPU op names")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not (
        1 <= args.first_step and 1 <= args.steps and args.first_step + args.steps < args.new_tokens
    ):
        print(
            f"--first-step {args.first_step} --steps {args.steps}: the profiled steps must lie within the "
            f"response (1 <= first step, first step + steps < --new-tokens {args.new_tokens})",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    cuda = cuda_or_smoke(args.smoke)
    if cuda is None:
        return 2
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        variants = "default" if args.variants == "default,triton" else args.variants  # asked: kept
        args.shapes, args.batches, args.variants, args.mode = "smoke", "2", variants, "eager"
        args.prompt_len, args.new_tokens, args.first_step, args.steps = 8, 8, 2, 3
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS] + [
        s for s in args.shapes.split(",") if s not in shapes
    ]
    if unknown:
        print(f"unknown variant(s) / shape(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gpu = torch.cuda.get_device_name() if cuda else ""
    tb_s = args.peak_tb_s or next((v for k, v in PEAK_TB_S.items() if k in gpu), DEFAULT_TB_S)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, smoke=args.smoke, peak_tb_s=tb_s)
    rows, models = [], {}
    todo = cells(args.shapes.split(","), [int(b) for b in args.batches.split(",")], args.variants.split(","))
    for shape_name, batch, variant in todo:
        shape = shapes[shape_name]
        element_size = torch.finfo(dtype).bits // 8
        steps = range(args.first_step + 1, args.first_step + args.steps + 1)
        padded = -(-args.prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET  # the prompt as the engine pads it
        slots = kv_slots_read(args.mode, padded, args.new_tokens, steps)
        row = {
            "shape": shape_name,
            "batch": batch,
            "variant": variant,
            "mode": args.mode,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "kv_slots": slots,
            "peak_tb_s": tb_s,
        }
        row["weight_bytes"] = llama_weight_bytes(shape, batch, element_size)
        row["kv_bytes"] = kv_read_bytes(shape, batch, slots, element_size)
        if variant in INT8:  # one byte an element and one fp32 scale per head vector
            head_dim = shape["hidden_size"] // shape["num_attention_heads"]
            row["kv_bytes"] = kv_read_bytes(shape, batch, slots, 1) * (1 + 4 / head_dim)
        row["floor_ms"] = floor_ms(row["weight_bytes"] + row["kv_bytes"], tb_s)
        need = estimate_gib(shape, batch, padded, args.new_tokens, element_size)
        # the whole device less a margin (the process holds nothing else between cells)
        limit = args.memory_gib or (torch.cuda.mem_get_info()[1] / 2**30 * 0.92 if cuda else float("inf"))
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            row["status"] = f"skipped: time budget ({elapsed:.0f} s > {args.budget_s:.0f} s)"
        elif need > limit:
            row["status"] = f"skipped: needs ~{need:.0f} GiB, {limit:.0f} GiB available"
        else:
            if shape_name not in models:
                models.clear()  # one model at a time
                gc.collect()
                models[shape_name] = build_model(shape, device, dtype, args.prompt_len + args.new_tokens + 64)
            model = models[shape_name]
            try:
                with torch.no_grad():
                    row.update(profile_cell(model, shape, variant, batch, args, cuda))
                row["x_floor"] = row["wall_ms"] / row["floor_ms"]
            except torch.cuda.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as exc:  # noqa: BLE001 - one failing cell must not lose the others
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}, default=str), flush=True)
        write_results(out, env, rows)  # after every cell: a killed run keeps what it measured
    env["wall_s"] = round(time.perf_counter() - start, 1)
    write_results(out, env, rows)
    print(f"wrote {out}/results.json, results.csv, profile.png in {env['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
