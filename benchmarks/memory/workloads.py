"""Training workloads measured by ``run.py``: one function per scenario, each returning a JSON-ready dict.

A scenario runs in its own process on the GPU (the allocator's ``expandable_segments`` is fixed when CUDA
initialises), so ``run.py`` starts ``python workloads.py SCENARIO OUT.json [--smoke] [--rounds N]`` for each.

The allocator scenario times its variants (no callback, callback at several thresholds) fairly: one untimed
warm-up pass of the whole length schedule first (cuBLAS handles and workspaces, kernel choice for every
shape, the callback's code path), then ``rounds`` rounds in which every variant runs once, in an order that
changes from round to round (a Williams Latin square: over ``len(variants)`` rounds each variant sits once in
each position and follows each other variant once). Every window starts from the same state (empty
optimizer state, empty allocator cache, peak counters reset). The time cost of the callback is the median,
over rounds, of the paired difference "callback minus no callback" of the round totals, with its min/max.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_shape

SIZES = {
    "1b": LLAMA_SHAPES["llama-1.1b"],  # the 1.1B Llama shape of DESIGN.md
    "smoke": llama_shape("smoke", vocab_size=64),
}


SETTINGS = {
    # sequence lengths, micro-batch, steps per window (all timed), `warmup_passes` untimed passes of the
    # whole schedule before the timed `rounds` (each round: every variant once); checkpointing runs at
    # `sac_len` tokens, and the micro-batch search at `search_len` tokens up to `search_cap`
    "full": dict(size="1b", lengths=(512, 2048, 4096), jitter=255, batch=4, steps=24, warmup_passes=1,
                 rounds=4, sac_len=4096, sac_steps=4, search_len=2048, search_cap=64),
    "smoke": dict(size="smoke", lengths=(32, 64, 128), jitter=8, batch=2, steps=4, warmup_passes=1,
                  rounds=2, sac_len=128, sac_steps=1, search_len=64, search_cap=2),
}  # fmt: skip


def setting(smoke: bool) -> dict:
    """Settings of a full (H200) or smoke (CPU) run (a copy: callers add to it)."""
    return dict(SETTINGS["smoke" if smoke else "full"])


def length_schedule(cfg: dict, seed: int = 0) -> list[int]:
    """Per-step sequence lengths: 512/2048/4096 in random order, jittered like real response lengths."""
    rng = random.Random(seed)
    return [max(8, rng.choice(cfg["lengths"]) - rng.randint(0, cfg["jitter"])) for _ in range(cfg["steps"])]


def build(cfg: dict):
    """Model (bf16 on CUDA, fp32 on CPU) and AdamW."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = LlamaConfig(**SIZES[cfg["size"]], max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # random init directly on the GPU: seconds instead of minutes on the CPU
        model = LlamaForCausalLM(config).to(dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    return model, opt, device


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_step(model, opt, device, batch: int, length: int, vocab: int) -> float:
    """One optimizer step on random tokens; returns its wall time (synchronised: benchmark only)."""
    import torch

    ids = torch.randint(0, vocab, (batch, length), device=device)
    sync()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def fragmentation_run(cfg: dict, model, opt, device, callback=None) -> dict:
    """One timed window: all steps of the length schedule, recording memory after each (the sawtooth).

    The caller starts the window from a clean state (``reset``); the peak counters are reset here at the
    window's start and again before every step, so each step's ``peak_reserved`` covers that step and the
    callback's work after it, and ``max_reserved`` is the peak of this window alone. Allocator retries are
    counted from the window's start (the allocator's counter is cumulative over the process).
    """
    import torch

    from rapidfire_hf.memory import sample_memory

    vocab = model.config.vocab_size
    steps = []
    if callback is not None:
        callback.start(model=model, optimizer=opt)  # opens the telemetry stream, as a training run would
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    retries_before = sample_memory().num_alloc_retries or 0
    for step, length in enumerate(length_schedule(cfg), start=1):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        seconds = train_step(model, opt, device, cfg["batch"], length, vocab)
        tick = time.perf_counter()
        compacted = 0
        if callback is not None:
            compacted = callback.maybe_compact(callback.sample("step_end", step), step)
        overhead = time.perf_counter() - tick
        s = sample_memory()
        steps.append(
            {
                "step": step,
                "length": length,
                "seconds": seconds + overhead,
                "callback_s": overhead,
                "allocated": s.allocated,
                "reserved": s.reserved,
                "peak_allocated": s.peak_allocated,
                "peak_reserved": s.peak_reserved,
                "fragmentation": s.fragmentation,
                "inactive_split_bytes": s.inactive_split_bytes,
                "alloc_retries": (s.num_alloc_retries or 0) - retries_before,
                "compacted_bytes": compacted,
            }
        )
    return {
        "steps": steps,
        "total_s": sum(x["seconds"] for x in steps),
        "callback_s": sum(x["callback_s"] for x in steps),
        "max_reserved": max((x["peak_reserved"] or 0) for x in steps),
        "mean_fragmentation": statistics.fmean(x["fragmentation"] or 0.0 for x in steps),
        "compactions": sum(1 for x in steps if x["compacted_bytes"]),
        "alloc_retries": steps[-1]["alloc_retries"],
    }


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """Order of the variants in each round: rows of a Williams Latin square, cycled.

    For an even number of variants, every ``len(names)`` rounds each variant runs once in each position and
    directly after each other variant once, so neither position nor predecessor favours any variant. (For
    an odd number the mirrored rows follow the plain ones, which balances over ``2 * len(names)`` rounds.)
    """
    n = len(names)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:  # 0, 1, n-1, 2, n-2, ...
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[i] for i in rows[r % len(rows)]] for r in range(rounds)]


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def time_cost(variants: dict, base: str = "no_callback") -> dict:
    """Per callback variant: paired per-round differences of the window totals against ``base``.

    ``variants[name]["rounds"]`` lists one window per round (same round index = same round). Returns, per
    variant, the per-round differences in seconds and relative to that round's ``base`` total, with their
    median, min and max.
    """
    ref = [w["total_s"] for w in variants[base]["rounds"]]
    out = {}
    for name, v in variants.items():
        if name == base:
            continue
        diff = [w["total_s"] - b for w, b in zip(v["rounds"], ref)]
        rel = [d / b if b else None for d, b in zip(diff, ref)]
        out[name] = {
            "diff_s_per_round": diff,
            "rel_per_round": rel,
            "diff_s": _spread(diff),
            "rel": _spread(rel) if all(r is not None for r in rel) else None,
        }
    return out


def make_callback(cfg: dict, threshold: float):
    from rapidfire_hf.memory import MemoryCompactionCallback, TelemetryWriter

    telemetry = TelemetryWriter(cfg["out_dir"] + "/telemetry", register=False)
    return MemoryCompactionCallback(
        compaction_threshold=threshold,
        optimization="aggressive",
        telemetry=telemetry,
        expandable_segments=False,
    )


def run_window(cfg: dict, model, opt, device, threshold: float | None) -> dict:
    """``reset`` to the common starting state, then one ``fragmentation_run`` with or without the callback."""
    reset(model, opt)
    cb = make_callback(cfg, threshold) if threshold is not None else None
    try:
        return fragmentation_run(cfg, model, opt, device, cb)
    finally:
        if cb is not None:
            cb.telemetry.close()


def reset(model, opt):
    import torch

    opt.state.clear()  # each variant starts from empty optimizer state...
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():  # ...and an empty cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def largest_micro_batch(cfg: dict, model, opt, device) -> int:
    """Largest power-of-two micro-batch at ``search_len`` tokens that trains without OOM (up to a cap)."""
    import torch

    best, batch = 0, 1
    while batch <= cfg["search_cap"]:
        try:
            train_step(model, opt, device, batch, cfg["search_len"], model.config.vocab_size)
        except torch.OutOfMemoryError:
            break
        finally:
            opt.zero_grad(set_to_none=True)
            reset(model, opt)
        best, batch = batch, batch * 2
    return best


def scenario_allocator(cfg: dict) -> dict:
    """Fragmentation with and without the callback, under the allocator this process was started with.

    One untimed warm-up pass, then ``cfg["rounds"]`` rounds of all variants in a changing order (see the
    module docstring). Memory numbers and the step trace of a variant are those of its first timed window;
    each window's own numbers are kept under ``rounds``.
    """
    import os

    import torch

    model, opt, device = build(cfg)
    out = {"alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if torch.cuda.is_available():  # check that the setting took: segments say whether they are expandable
        segments = torch.cuda.memory._snapshot()["segments"]
        out["expandable_segments_seen"] = any(seg.get("is_expandable") for seg in segments)
    variants = {"no_callback": None}
    # threshold 1.0 never compacts: what sampling and telemetry alone cost
    for threshold in (1.0, 0.3, 0.15):
        variants[f"callback_t{threshold}"] = threshold
    # warm-up: the whole schedule, with a compacting callback so its code path is warm too; not timed
    warm = "callback_t0.3"
    out["warmup"] = [
        {"variant": warm, "total_s": run_window(cfg, model, opt, device, variants[warm])["total_s"]}
        for _ in range(cfg["warmup_passes"])
    ]
    orders = round_orders(list(variants), cfg["rounds"])
    out["rounds"] = cfg["rounds"]
    out["orders"] = orders
    windows: dict[str, list[dict]] = {name: [] for name in variants}
    for r, order in enumerate(orders):
        for position, name in enumerate(order):
            w = run_window(cfg, model, opt, device, variants[name])
            w.update(round=r, position=position)
            windows[name].append(w)
    for name, ws in windows.items():
        first = ws[0]
        out[name] = {
            "steps": first["steps"],  # the sawtooth of the first timed window
            "max_reserved": first["max_reserved"],
            "mean_fragmentation": first["mean_fragmentation"],
            "compactions": first["compactions"],
            "alloc_retries": first["alloc_retries"],
            "step_s_median": statistics.median(x["seconds"] for w in ws for x in w["steps"]),
            "total_s_median": statistics.median(w["total_s"] for w in ws),
            "callback_s_median": statistics.median(w["callback_s"] for w in ws),
            "rounds": [{k: v for k, v in w.items() if k != "steps"} for w in ws],
        }
    out["time_cost"] = time_cost({name: out[name] for name in variants})
    reset(model, opt)
    out["largest_micro_batch"] = largest_micro_batch(cfg, model, opt, device)
    return out


def scenario_checkpointing(cfg: dict) -> dict:
    """Peak memory and step time at ``sac_len`` tokens, and the largest micro-batch, per level."""
    import torch

    from rapidfire_hf.memory import apply_selective_checkpointing

    out = {}
    for level in ("conservative", "balanced", "aggressive"):
        model, opt, device = build(cfg)
        apply_selective_checkpointing(model, level)
        reset(model, opt)
        times = [
            train_step(model, opt, device, cfg["batch"], cfg["sac_len"], model.config.vocab_size)
            for _ in range(cfg["sac_steps"] + 1)
        ][1:]  # the first step pays for cuBLAS/allocator warm-up
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        reset(model, opt)
        out[level] = {
            "step_s": statistics.median(times),
            "peak_allocated": peak,
            "largest_micro_batch": largest_micro_batch(cfg, model, opt, device),
        }
        del model, opt
        reset_all()
    return out


def reset_all():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


SCENARIOS = {"allocator": scenario_allocator, "checkpointing": scenario_checkpointing}


def main(argv: list[str]) -> None:
    name, out_path, smoke = argv[0], argv[1], "--smoke" in argv
    cfg = setting(smoke)
    if "--rounds" in argv:
        cfg["rounds"] = int(argv[argv.index("--rounds") + 1])
    cfg["out_dir"] = str(Path(out_path).parent)
    result = SCENARIOS[name](cfg)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
