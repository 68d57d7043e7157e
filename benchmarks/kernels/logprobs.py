"""Token log-probs for PPO training (issue 31, item 3): the project's chunked log-prob against TRL 1.16's and
Liger's, with plain PyTorch on the full logits, on the PPO shapes.

Each implementation maps final hidden states ``[N, H]`` (bf16 on the GPU), the LM head ``[V, H]`` and the
drawn tokens ``[N]`` to the tokens' log-probs ``[N]`` (temperature 1), differentiable in both inputs:

- ``torch``: ``log_softmax((h @ W.T).float()).gather(tokens)``, the full ``[N, V]`` logits (what
  ``trl.trainer.utils.selective_log_softmax`` does on logits that exist);
- ``rapidfire``: ``rapidfire_hf.kernels.chunked_logprobs`` (row chunks of 1024, fp32 softmax, backward
  recomputes each chunk);
- ``trl``: ``trl.kernels.ChunkedLogProbFunction`` (TRL >= 1.16: cuBLAS tiles of 4096 tokens x the vocabulary
  tile TRL's trainer uses, folded by a Triton kernel on the GPU, torch ops elsewhere);
- ``liger``: ``LigerFusedLinearPPOBase.chunk_forward`` (liger-kernel 0.8: the per-token log-prob inside its
  chunked PPO loss, token x vocabulary chunks in torch ops); skipped when liger-kernel is not installed.

The reference is the ``torch`` path in fp32 (fp32 copies of the inputs, no TF32). Per (shape, rows) cell
and mode (``fwd``: under ``no_grad``, as PPO scores old / reference log-probs; ``fwd+bwd``: backward of
``sum(logprobs * g)`` for a random upstream ``g``, as the PPO loss sends): the median of ``--repeats`` timed
calls after ``--warmup`` (device synchronised), the peak memory above the inputs, and the max abs error of
the log-probs (and of both gradients, absolute and relative to the reference's largest entry).
Rows are appended to results.json / results.csv as each cell finishes; chart: logprobs.png.

    python benchmarks/kernels/logprobs.py --out OUT            # one H200: ~40 s
    python benchmarks/kernels/logprobs.py --out OUT --smoke    # CPU, fp32, tiny shapes: seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    LLAMA_SHAPES,
    cuda_or_smoke,
    environment,
    save_figure,
    timed,
    write_csv,
    write_json,
)
from benchmarks.common.charts import pyplot  # noqa: E402

SHAPES = {
    name: (LLAMA_SHAPES[name]["hidden_size"], LLAMA_SHAPES[name]["vocab_size"])
    for name in ("llama-1.1b", "llama-7b")
}
SMOKE_SHAPES = {"smoke": (64, 512)}
IMPLS = ("torch", "rapidfire", "trl", "liger")
MODES = ("fwd", "fwd+bwd")
TRL_VOCAB_TILE = (
    32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16 (read from TRL when present)
)


def torch_logprobs(hidden, weight, tokens):
    """``[N]`` log-probs from the full ``[N, V]`` logits (fp32 softmax)."""
    logits = (hidden @ weight.t()).float()
    return logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def rapidfire_logprobs(hidden, weight, tokens):
    from rapidfire_hf.kernels import chunked_logprobs

    return chunked_logprobs(hidden, weight, tokens, backend="rapidfire")


def trl_logprobs(hidden, weight, tokens):
    from trl.kernels import ChunkedLogProbFunction

    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as tile
    except ImportError:
        tile = TRL_VOCAB_TILE
    # (hidden, weight, bias, targets, temperature, vocabulary tile, soft-capping, logit scale, extra outputs)
    return ChunkedLogProbFunction.apply(hidden, weight, None, tokens, 1.0, tile, None, 1.0, ())[0]


def liger_logprobs(hidden, weight, tokens):
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    return LigerFusedLinearPPOBase.chunk_forward(hidden[None], weight, tokens[None], None, 1.0)[0]


FUNCTIONS = {
    "torch": torch_logprobs,
    "rapidfire": rapidfire_logprobs,
    "trl": trl_logprobs,
    "liger": liger_logprobs,
}


def unavailable_reason(impl: str) -> str | None:
    """Why ``impl`` cannot run here (its package missing or too old), or None."""
    try:
        if impl == "trl":
            from trl.kernels import ChunkedLogProbFunction  # noqa: F401
        elif impl == "liger":
            from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc})"
    return None


def reference(hidden, weight, tokens, upstream) -> dict:
    """fp32 log-probs and the gradients of ``sum(logprobs * upstream)`` in hidden and weight."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    lp = torch_logprobs(h, w, tokens)
    (lp * upstream).sum().backward()
    return {"logprobs": lp.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}


def errors(out: dict, ref: dict) -> dict:
    """Max abs error of each output against the reference, and relative to the reference's largest entry."""
    errs = {}
    for key, value in out.items():
        diff = (value.float() - ref[key]).abs().max().item()
        errs[f"{key}_max_abs_err"] = diff
        if key != "logprobs":
            errs[f"{key}_rel_err"] = diff / max(ref[key].abs().max().item(), 1e-30)
    return errs


def run_impl(impl: str, mode: str, hidden, weight, tokens, upstream, args, device: str) -> dict:
    """Outputs (for the errors), time and peak memory of one implementation in one mode."""
    fn = FUNCTIONS[impl]
    cuda = device == "cuda"

    def call():
        if mode == "fwd":
            with torch.no_grad():
                return {"logprobs": fn(hidden, weight, tokens)}
        hidden.grad = weight.grad = None
        lp = fn(hidden, weight, tokens)
        (lp * upstream).sum().backward()
        return {"logprobs": lp.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad}

    outputs = call()
    err = errors(outputs, args.ref)
    del outputs
    stats = timed(call, repeats=args.repeats, warmup=args.warmup, device=device)
    row = {
        "status": "ok",
        "ms": stats["median"] * 1e3,
        "ms_min": stats["min"] * 1e3,
        "ms_max": stats["max"] * 1e3,
    }
    if cuda:
        hidden.grad = weight.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    hidden.grad = weight.grad = None
    return {**row, **err}


def cell_rows(shape: str, rows: int, args, device: str, dtype) -> list[dict]:
    """Every implementation and mode on one (shape, rows) cell, each row printed as it ends."""
    hidden_size, vocab = (SMOKE_SHAPES if args.smoke else SHAPES)[shape]
    g = torch.Generator(device).manual_seed(rows)
    hidden = torch.randn(rows, hidden_size, device=device, generator=g).to(dtype).requires_grad_()
    # std 0.02 (HF's init) gives logits of std ~0.9-1.3 at these widths, as a trained head's are in scale
    weight = (torch.randn(vocab, hidden_size, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,), device=device, generator=g)
    upstream = torch.randn(rows, device=device, generator=g)
    args.ref = reference(hidden, weight, tokens, upstream)
    out = []
    for mode in MODES:
        for impl in args.impls:
            row = {
                "shape": shape,
                "hidden": hidden_size,
                "vocab": vocab,
                "rows": rows,
                "mode": mode,
                "impl": impl,
            }
            reason = unavailable_reason(impl)
            try:
                row.update(
                    {"status": f"skipped: {reason}"}
                    if reason
                    else run_impl(impl, mode, hidden, weight, tokens, upstream, args, device)
                )
            except torch.cuda.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not lose the others
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            hidden.grad = weight.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
            out.append(row)
            print(json.dumps(row), flush=True)
    args.ref = None
    return out


def write_results(out: Path, env: dict, rows: list[dict]) -> None:
    write_json(out / "results.json", {"environment": env, "rows": rows})
    write_csv(out / "results.csv", rows)
    chart(out / "logprobs.png", env, rows)


def chart(path: Path, env: dict, rows: list[dict]) -> None:
    """Grouped bars: milliseconds per call of each implementation, per (shape, rows, mode)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    groups = list(dict.fromkeys((r["shape"], r["rows"], r["mode"]) for r in ok))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 2), 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        for j, group in enumerate(groups):
            match = [r for r in ok if (r["shape"], r["rows"], r["mode"]) == group and r["impl"] == impl]
            if match:
                ax.bar(j + i * width, match[0]["ms"], width, color=f"C{i}", label=impl if j == 0 else None)
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(groups))],
        [f"{s}\n{n} rows\n{m}" for s, n, m in groups],
        fontsize=7,
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (median, log scale)")
    ax.set_title(f"token log-probs from hidden states, {env.get('gpu') or 'cpu (smoke)'}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="8,64,256", help="rollout batches; rows = batch x --response-len")
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget-s", type=float, default=1e9, help="cells not started within this many s are skipped"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny shapes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    cuda = cuda_or_smoke(args.smoke)
    if cuda is None:
        return 2
    if args.smoke:
        args.shapes, args.batches, args.response_len = "smoke", "2,3", 8
    args.impls = [i for i in args.impls.split(",") if i]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    unknown = [i for i in args.impls if i not in IMPLS] + [
        s for s in args.shapes.split(",") if s not in shapes
    ]
    if unknown:
        print(f"unknown implementation(s) / shape(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32; bf16 is unaffected
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, smoke=args.smoke, dtype=str(dtype).removeprefix("torch."))
    rows = []
    # smallest batch of every shape first: a short budget still covers both shapes
    for batch in [int(b) for b in args.batches.split(",")]:
        for shape in args.shapes.split(","):
            n = batch * args.response_len
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                status = f"skipped: time budget ({elapsed:.0f} s > {args.budget_s:.0f} s)"
                rows += [
                    {"shape": shape, "rows": n, "mode": m, "impl": i, "status": status}
                    for m in MODES
                    for i in args.impls
                ]
                continue
            try:
                rows += cell_rows(shape, n, args, device, dtype)
            except torch.cuda.OutOfMemoryError:  # the fp32 reference itself
                rows += [
                    {"shape": shape, "rows": n, "mode": m, "impl": i, "status": "OOM (reference)"}
                    for m in MODES
                    for i in args.impls
                ]
            args.ref = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            write_results(out, env, rows)  # after every cell: a killed run keeps what it measured
    env["wall_s"] = round(time.perf_counter() - start, 1)
    write_results(out, env, rows)
    print(f"wrote {out}/results.json, results.csv, logprobs.png in {env['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
