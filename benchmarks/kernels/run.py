"""benchmarks/kernels: the project's Triton decode kernels against their PyTorch paths and the bandwidth floor.

Three kernels, each at the decode shapes of the 1.1B and 7B Llama (batch 8, 64, 256; cache 512 slots):

- ``attention``: one decode token's GQA attention over a bf16 static cache, ``gqa_decode_attention`` with
  ``impl="sdpa"`` (the default), ``"matmul"`` and ``"triton"`` (``kernels/triton_flash_decode.py``);
  the floor is the cache bytes (K and V of one layer) / the GPU's peak bandwidth.
- ``sampling``: temperature sampling and the drawn token's log-prob from ``[B, 32000]`` logits,
  ``sample_tokens`` on the fp32 logits as the engine runs it (with its ``.float()`` of the bf16 logits)
  against ``fused_sample`` on the same noise and with its own Philox noise; the floor is the bytes of the
  bf16 logits (+ the fp32 noise for the rows that read it) / peak bandwidth.
- ``matmul``: the decode projections ``x [M, K] @ W.T`` (``W`` ``[N, K]``, bf16) at M = 8 and 64 rows
  (``--matmul-rows``), ``F.linear`` (cuBLAS) against ``skinny_matmul`` (``kernels/triton_skinny_matmul.py``,
  opt-in, used by nothing yet); the error is against the fp32 product of the same bf16 inputs; the floor
  is the weight's bytes / peak bandwidth (``x`` and ``y`` are a few KiB).

Each row: correctness against the reference first (max abs difference, equal tokens), then the median of
``--repeats`` replays of a CUDA graph of 20 calls (CUDA events), after ``--warmup`` calls: GPU time per
call as the recorded decode step sees it, without the host's launch cost. Writes results.json / results.csv /
kernels.png.

    python benchmarks/kernels/run.py --out OUT                 # one H200: under a minute
    python benchmarks/kernels/run.py --out OUT --smoke         # CPU, Triton interpreter: the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import bar_chart, environment, write_csv, write_json  # noqa: E402

# (name, kv heads, query heads per kv head, head dim)
ATTENTION_SHAPES = {"llama-1.1b": (4, 8, 64), "llama-7b": (32, 1, 128)}
VOCAB = 32000
# decode projections [N, K] (nn.Linear weights); q and o share a shape, as do k and v, gate and up
MATMUL_SHAPES = {
    "llama-1.1b": {"q,o": (2048, 2048), "k,v": (256, 2048), "gate,up": (5632, 2048), "down": (2048, 5632),
                   "lm_head": (32000, 2048)},
    "llama-7b": {"q,k,v,o": (4096, 4096), "gate,up": (11008, 4096), "down": (4096, 11008),
                 "lm_head": (32000, 4096)},
}  # fmt: skip
SMOKE_MATMUL_SHAPES = {"smoke": {"q,o": (96, 64), "down": (64, 160), "lm_head": (200, 64)}}
PEAK_TB_S = {"H200": 4.8, "H100": 3.35}  # HBM peak of the GPUs this suite ran on (vendor figures)


def _time(fn, device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds of one call: on CUDA, ``repeats`` replays of a CUDA graph of 20 calls.

    The decode step runs as one recorded graph, so what counts is the GPU time of a call, not the host's
    launch cost (Triton's Python launcher alone is ~20-60 us per call, more than the kernels at batch 8).
    """
    for _ in range(warmup):
        fn()
    if device != "cuda":
        import time

        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize()
    per_graph = 20
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the side stream's allocator
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / per_graph)
    return statistics.median(samples)


def _peak_bytes_per_ms(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    tb_s = next((v for k, v in PEAK_TB_S.items() if k in name), None)
    return tb_s * 1e9 if tb_s else None  # bytes per millisecond


def attention_rows(args, device: str, dtype) -> list[dict]:
    from rapidfire_hf.kernels import gqa_decode_attention

    rows, per_ms = [], _peak_bytes_per_ms(device)
    for shape, (kv, group, d) in ATTENTION_SHAPES.items():
        for batch in args.batches:
            g = torch.Generator(device).manual_seed(0)
            q = torch.randn(batch, kv, group, d, device=device, generator=g)
            k = torch.randn(batch, kv, args.cache, d, device=device, generator=g)
            v = torch.randn(batch, kv, args.cache, d, device=device, generator=g)
            valid = torch.ones(batch, args.cache, dtype=torch.bool, device=device)
            valid[: batch // 2, : args.cache // 4] = False  # left padding on half of the rows
            ref = gqa_decode_attention(q, k, v, valid, d**-0.5, "matmul")  # fp32 reference
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            floor = 2 * k.numel() * k.element_size() / per_ms if per_ms else None
            for impl in ("sdpa", "matmul", "triton"):
                out = gqa_decode_attention(q, k, v, valid, d**-0.5, impl)
                call = partial(gqa_decode_attention, q, k, v, valid, d**-0.5, impl)
                ms = _time(call, device, args.warmup, args.repeats)
                rows.append(_timed_row("attention", shape, batch, impl, ms, floor, out, ref))
            if not args.end or args.end >= args.cache:
                continue
            # mid-response: only the first `end` slots are filled (the engine's step at slot end - 1); a
            # recorded step gives every implementation the whole cache, the Triton kernel also the bound
            valid[:, args.end :] = False
            ref = gqa_decode_attention(q.float(), k.float(), v.float(), valid, d**-0.5, "matmul")
            floor = floor * args.end / args.cache if floor else None
            kv_end = torch.tensor([args.end], device=device)
            for impl, bound in (("sdpa", None), ("triton", None), ("triton", kv_end)):
                call = partial(gqa_decode_attention, q, k, v, valid, d**-0.5, impl, bound)
                out = call()
                ms = _time(call, device, args.warmup, args.repeats)
                name = f"{impl}@{args.end}" + ("+kv_end" if bound is not None else "")
                rows.append(_timed_row("attention", shape, batch, name, ms, floor, out, ref))
    return rows


def attention_int8_rows(args, device: str, dtype) -> list[dict]:
    """The flash-decoding kernel over an int8 cache (one fp32 scale per head vector, ``kernels/kv_quant.py``)
    at the mid-response bound, once per ``--launches`` entry (:class:`Launch`): which launch reads the 8-bit
    cache fastest. The reference is the fp32 attention over the dequantized cache; the floor the int8 slots
    and their scales up to the bound."""
    from rapidfire_hf.kernels.kv_quant import dequantize, kv_format, quantize
    from rapidfire_hf.kernels.triton_flash_decode import flash_decode

    rows, per_ms, fmt = [], _peak_bytes_per_ms(device), kv_format("int8")
    end = args.end or args.cache
    for shape, (kv, group, d) in ATTENTION_SHAPES.items():
        for batch in args.batches:
            g = torch.Generator(device).manual_seed(0)
            q = torch.randn(batch, kv, group, d, device=device, generator=g)
            (kq, ks), (vq, vs) = (
                quantize(torch.randn(batch, kv, args.cache, d, device=device, generator=g), fmt) for _ in "kv"
            )
            valid = torch.ones(batch, args.cache, dtype=torch.bool, device=device)
            valid[: batch // 2, : args.cache // 4] = False  # left padding on half of the rows
            valid[:, end:] = False
            k, v = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
            from rapidfire_hf.kernels import gqa_decode_attention

            ref = gqa_decode_attention(q, k, v, valid, d**-0.5, "matmul")
            del k, v
            q = q.to(dtype)
            floor = 2 * batch * kv * end * (d + 4) / per_ms if per_ms else None
            kv_end = torch.tensor([end], device=device)
            for launch in args.launches:
                call = partial(flash_decode, q, kq, vq, valid, d**-0.5, None, kv_end, ks, vs, launch)
                out = call()
                ms = _time(call, device, args.warmup, args.repeats)
                name = f"triton-int8@{end}+kv_end[{launch.block_n}x{launch.num_warps}x{launch.num_stages}]"
                rows.append(_timed_row("attention_int8", shape, batch, name, ms, floor, out, ref))
    return rows


def _timed_row(kernel: str, shape: str, batch: int, impl: str, ms: float, floor, out, ref) -> dict:
    """One table row: time, floor and the largest difference from the fp32 reference (printed as it lands)."""
    row = {
        "kernel": kernel,
        "shape": shape,
        "batch": batch,
        "impl": impl,
        "ms": ms,
        "floor_ms": floor,
        "x_floor": ms / floor if floor else None,
        "max_abs_diff": (out.float() - ref).abs().max().item(),
    }
    print(row, flush=True)
    return row


def _torch_sample(logits, params, noise):
    from rapidfire_hf.rollout.sampling import sample_tokens

    return sample_tokens(logits.float(), params, noise)


def sampling_rows(args, device: str, dtype) -> list[dict]:
    from rapidfire_hf.kernels.triton_sampling import fused_sample
    from rapidfire_hf.rollout.sampling import philox_seeds, sample_tokens
    from rapidfire_hf.rollout.types import SamplingParams

    rows, per_ms = [], _peak_bytes_per_ms(device)
    params = SamplingParams(temperature=0.7)
    for batch in args.batches:
        g = torch.Generator(device).manual_seed(0)
        logits = (torch.randn(batch, args.vocab, device=device, generator=g) * 3).to(dtype)
        noise = torch.rand(batch, args.vocab, device=device, generator=g)
        seeds = philox_seeds(None, batch, device)
        step = torch.ones(1, dtype=torch.long, device=device)
        ref_tok, ref_lp = sample_tokens(logits.float(), params, noise)
        calls = {  # the engine's torch path casts the bf16 logits to fp32 first
            "torch": partial(_torch_sample, logits, params, noise),
            "triton": partial(fused_sample, logits, 0.7, True, noise),
            "triton-philox": partial(fused_sample, logits, 0.7, True, seeds=seeds, step=step),
        }
        for impl, call in calls.items():
            tok, lp = call()
            read = logits.numel() * logits.element_size() + (
                noise.numel() * 4 if impl != "triton-philox" else 0
            )
            floor = read / per_ms if per_ms else None
            same = impl != "triton-philox"  # Philox draws other noise: only the log-probs are comparable
            ms = _time(call, device, args.warmup, args.repeats)
            rows.append(
                {
                    "kernel": "sampling",
                    "shape": f"vocab {args.vocab}",
                    "batch": batch,
                    "impl": impl,
                    "ms": ms,
                    "floor_ms": floor,
                    "x_floor": ms / floor if floor else None,
                    "max_abs_diff": (lp - ref_lp).abs().max().item() if same else None,
                    "same_tokens": bool(torch.equal(tok, ref_tok)) if same else None,
                }
            )
            print(rows[-1], flush=True)
    return rows


def matmul_rows(args, device: str, dtype) -> list[dict]:
    import torch.nn.functional as F

    from rapidfire_hf.kernels.triton_skinny_matmul import skinny_matmul

    rows, per_ms = [], _peak_bytes_per_ms(device)
    shapes = SMOKE_MATMUL_SHAPES if args.smoke else MATMUL_SHAPES
    for model, projections in shapes.items():
        for proj, (n, k) in projections.items():
            for m in args.matmul_rows:
                g = torch.Generator(device).manual_seed(0)
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)  # outputs ~N(0, 1)
                ref = x.float() @ w.float().T  # fp32 product of the same rounded inputs (TF32 is off)
                floor = w.numel() * w.element_size() / per_ms if per_ms else None
                calls = {"torch": partial(F.linear, x, w), "triton": partial(skinny_matmul, x, w)}
                for impl, call in calls.items():
                    out = call()
                    ms = _time(call, device, args.warmup, args.repeats)
                    rows.append(_timed_row("matmul", f"{model} {proj} {n}x{k}", m, impl, ms, floor, out, ref))
                del x, w, ref
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="8,64,256")
    p.add_argument("--matmul-rows", default="8,64", help="rows M of the matmul section")
    p.add_argument("--cache", type=int, default=512, help="cache slots attended (prompt + response)")
    p.add_argument(
        "--end",
        type=int,
        default=320,
        help="filled slots of the mid-response rows (0: none); 320 is the "
        "mean over the steps of 128 + 384 tokens",
    )
    p.add_argument(
        "--kernels",
        default="attention,sampling,matmul",
        help="which sections to run, of attention, attention_int8, sampling, matmul",
    )
    p.add_argument(
        "--launches",
        default="64x4x3",
        help="attention_int8: the flash-decoding kernel's launches to time, BLOCKxWARPSxSTAGES, comma-separated",
    )
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args(argv)
    if not 0 <= args.end <= args.cache:
        print(
            f"--end {args.end}: give 0 (no mid-response rows) up to --cache ({args.cache})", file=sys.stderr
        )
        return 2
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.matmul_rows = [int(m) for m in args.matmul_rows.split(",") if m]
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        if not args.smoke:
            print("no CUDA device: run with --smoke (Triton's interpreter, tiny shapes)", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        args.batches, args.cache, args.vocab, args.warmup, args.repeats = [2], 64, 256, 1, 2
        args.end = 40
        args.matmul_rows = [3]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from rapidfire_hf.kernels.triton_flash_decode import Launch  # after TRITON_INTERPRET is set

    try:
        args.launches = [Launch.parse(x) for x in args.launches.split(",") if x]
    except ValueError as exc:
        print(f"--launches: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    env["command"] = " ".join(["python", "benchmarks/kernels/run.py", *(argv or sys.argv[1:])])
    sections = {
        "attention": attention_rows,
        "attention_int8": attention_int8_rows,
        "sampling": sampling_rows,
        "matmul": matmul_rows,
    }
    picked = [k for k in args.kernels.split(",") if k]
    if unknown := [k for k in picked if k not in sections]:
        print(f"unknown --kernels {', '.join(unknown)}; known: {', '.join(sections)}", file=sys.stderr)
        return 2
    rows = [row for k in picked for row in sections[k](args, device, dtype)]
    write_json(out / "results.json", {"environment": env, "rows": rows})
    write_csv(out / "results.csv", rows)
    bar_chart(
        out / "kernels.png",
        [f"{r['kernel']} {r['shape']} b{r['batch']} {r['impl']}" for r in rows],
        [r["ms"] * 1e3 for r in rows],
        f"decode kernels, {env.get('gpu') or device} (median of {args.repeats} calls)",
        "microseconds per call",
    )
    print(f"wrote {out}/results.json, results.csv, kernels.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
