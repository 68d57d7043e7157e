"""Training workloads measured by ``run.py``: one function per scenario, each returning a JSON-ready dict.

A scenario runs in its own process on the GPU (the allocator's ``expandable_segments`` is fixed when CUDA
initialises), so ``run.py`` starts ``python workloads.py SCENARIO OUT.json [--smoke] [--rounds N]
[--variants A,B,...] [--batch-variants A,B,...]`` for each.

The allocator scenario times its variants (no callback, the callback with the settings ``PPOTrainer`` and
``enable_rapidfire`` install, the callback at explicit thresholds) fairly: one untimed warm-up pass of the
whole length schedule first (cuBLAS handles and workspaces, kernel choice for every shape, the callback's
code path), then ``rounds`` rounds in which every variant runs once, in an order that changes from round to
round (a Williams Latin square: over ``len(variants)`` rounds each variant sits once in each position and
follows each other variant once). Every window starts from the same state (empty optimizer state, empty
allocator cache, peak counters reset). The time cost of the callback is the median, over rounds, of the
paired difference "callback minus no callback" of the round totals, with its min/max.

It then searches the largest micro-batch at ``search_len`` tokens twice: from an empty cache, and right
after the fragmenting schedule run with and without the callback (``--batch-variants``), each probe
replaying the schedule from the common starting state.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_shape

SIZES = {
    "1b": LLAMA_SHAPES["llama-1.1b"],  # the 1.1B Llama shape of the README's numbers
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


# Callback variants: name -> MemoryCompactionCallback keyword arguments on top of MemoryConfig() (None: no
# callback). The threshold variants use the `aggressive` level (at least 5 steps between compactions) and
# pressure_fraction=0 (compact on the threshold whatever the GPU holds, as measured before the pressure
# condition existed); callback_default adds nothing: what PPOTrainer and enable_rapidfire install
# (threshold 0.3, `balanced`: 20 steps apart, and, with either allocator, only once 85% of the GPU is
# reserved).
CALLBACK_VARIANTS = {
    "no_callback": None,
    "callback_t1.0": dict(compaction_threshold=1.0, optimization="aggressive", pressure_fraction=0.0),
    "callback_t0.3": dict(compaction_threshold=0.3, optimization="aggressive", pressure_fraction=0.0),
    "callback_t0.15": dict(compaction_threshold=0.15, optimization="aggressive", pressure_fraction=0.0),
    "callback_default": {},
}
# timed by default: four variants, so 4 rounds are a whole Williams square (callback_t0.15 bought nothing
# over 0.3 on the H200; add it with --variants)
DEFAULT_VARIANTS = ("no_callback", "callback_t1.0", "callback_t0.3", "callback_default")
# the largest micro-batch after the fragmenting schedule, without and with the default callback
BATCH_VARIANTS = ("no_callback", "callback_default")


def setting(smoke: bool) -> dict:
    """Settings of a full (H200) or smoke (CPU) run (a copy: callers add to it)."""
    return dict(SETTINGS["smoke" if smoke else "full"])


@contextlib.contextmanager
def smoke_threads(smoke: bool):
    """One CPU thread while a smoke run lasts (restored after): the tiny model gains nothing from more,
    and on a busy CI machine two spinning threads made each step about 10x slower (25 vs 316 ms)."""
    import torch

    before = torch.get_num_threads()
    if smoke:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def train_step(model, opt, device, batch: int, length: int, vocab: int, before_optimizer_step=None) -> float:
    """One optimizer step on random tokens; returns its wall time (synchronised: benchmark only).

    ``before_optimizer_step`` runs between backward and ``opt.step()``, where ``transformers.Trainer``
    calls its callbacks' ``on_pre_optimizer_step``.
    """
    import torch

    ids = torch.randint(0, vocab, (batch, length), device=device)
    sync()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    if before_optimizer_step is not None:
        before_optimizer_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def fragmentation_run(cfg: dict, model, opt, device, callback=None) -> dict:
    """One timed window: all steps of the length schedule, recording memory after each (the sawtooth).

    The callback runs through its ``transformers.TrainerCallback`` hooks, as in a ``Trainer`` (and as
    ``PPOTrainer`` installs it): ``on_pre_optimizer_step`` between backward and the optimizer step,
    ``on_step_end`` after it (sampling, and compacting when its rule says so). Their time counts in the
    step's time and in ``callback_s``.

    The caller starts the window from a clean state (``reset``); the peak counters are reset here at the
    window's start and again before every step, so each step's ``peak_reserved`` covers that step and the
    callback's work after it, and ``max_reserved`` is the peak of this window alone. Allocator retries are
    counted from the window's start (the allocator's counter is cumulative over the process).
    """
    import torch

    from rapidfire_hf.memory import sample_memory

    vocab = model.config.vocab_size
    steps = []
    hooks = TrainerHooks(callback, model, opt) if callback is not None else None
    if callback is not None:
        callback.start(model=model, optimizer=opt)  # opens the telemetry stream, as on_train_begin would
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    retries_before = sample_memory().num_alloc_retries or 0
    for step, length in enumerate(length_schedule(cfg), start=1):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        pre = hooks.pre_optimizer_step(step) if hooks else None
        seconds = train_step(model, opt, device, cfg["batch"], length, vocab, pre)
        compactions_before = len(callback.compactions) if callback is not None else 0
        returned_before = callback.bytes_returned if callback is not None else 0
        overhead = hooks.step_end(step) if hooks else 0.0
        s = sample_memory()
        steps.append(
            {
                "step": step,
                "length": length,
                "seconds": seconds + overhead,
                "callback_s": overhead + (hooks.pre_s if hooks else 0.0),
                "allocated": s.allocated,
                "reserved": s.reserved,
                "peak_allocated": s.peak_allocated,
                "peak_reserved": s.peak_reserved,
                "fragmentation": s.fragmentation,
                "inactive_split_bytes": s.inactive_split_bytes,
                "alloc_retries": (s.num_alloc_retries or 0) - retries_before,
                "compacted": callback is not None and len(callback.compactions) > compactions_before,
                "compacted_bytes": (callback.bytes_returned - returned_before) if callback is not None else 0,
            }
        )
    return {
        "steps": steps,
        "total_s": sum(x["seconds"] for x in steps),
        "callback_s": sum(x["callback_s"] for x in steps),
        "max_reserved": max((x["peak_reserved"] or 0) for x in steps),
        "mean_fragmentation": statistics.fmean(x["fragmentation"] or 0.0 for x in steps),
        "compactions": sum(1 for x in steps if x["compacted"]),
        "alloc_retries": steps[-1]["alloc_retries"],
    }


class TrainerHooks:
    """Calls a ``MemoryCompactionCallback``'s Trainer hooks with a real ``TrainerState``, timing them.

    ``pre_optimizer_step(step)`` returns the function ``train_step`` runs before ``opt.step()`` (its time
    lands in ``pre_s``); ``step_end(step)`` runs ``on_step_end`` and returns its time. ``args`` is None:
    the callback reads nothing from the training arguments in these hooks.
    """

    def __init__(self, callback, model, opt):
        from transformers.trainer_callback import TrainerControl, TrainerState

        self.callback, self.model, self.opt = callback, model, opt
        self.state, self.control = TrainerState(), TrainerControl()
        self.pre_s = 0.0

    def pre_optimizer_step(self, step: int):
        def hook():
            tick = time.perf_counter()
            self.state.global_step = step - 1  # the Trainer increments global_step after the optimizer step
            self.callback.on_pre_optimizer_step(
                None, self.state, self.control, model=self.model, optimizer=self.opt
            )
            self.pre_s = time.perf_counter() - tick

        self.pre_s = 0.0
        return hook

    def step_end(self, step: int) -> float:
        tick = time.perf_counter()
        self.state.global_step = step
        self.callback.on_step_end(None, self.state, self.control, model=self.model, optimizer=self.opt)
        return time.perf_counter() - tick


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


def make_callback(cfg: dict, name: str):
    """The ``MemoryCompactionCallback`` of variant ``name`` (see ``CALLBACK_VARIANTS``), writing its
    telemetry under ``out_dir``.

    It starts from ``MemoryConfig()``, the configuration ``PPOTrainer`` and ``enable_rapidfire`` pass when
    the user gives none, so ``callback_default`` is exactly what they install. The allocator must have been
    configured through the environment before CUDA initialised (``run.py`` does it; the callback then
    reports ``"user"`` and leaves it alone): otherwise the callback's default ``expandable_segments=True``
    would switch a native-allocator process to expandable segments half-way.
    """
    from rapidfire_hf.config import MemoryConfig
    from rapidfire_hf.memory import MemoryCompactionCallback, TelemetryWriter

    telemetry = TelemetryWriter(cfg["out_dir"] + "/telemetry", register=False)
    cb = MemoryCompactionCallback(MemoryConfig(), telemetry=telemetry, **CALLBACK_VARIANTS[name])
    if cb.allocator_setup not in ("user", "no-cuda"):
        raise RuntimeError(
            f"variant {name}: the callback configured the allocator itself ({cb.allocator_setup!r}); start "
            "this process with PYTORCH_ALLOC_CONF set (run.py sets expandable_segments:True or :False)"
        )
    return cb


def callback_settings(cfg: dict, name: str) -> dict:
    """The effective settings of variant ``name``'s callback (thresholds, level, pressure condition)."""
    cb = make_callback(cfg, name)
    out = {
        "kwargs": CALLBACK_VARIANTS[name],
        "compaction_threshold": cb.compaction_threshold,
        "optimization": cb.optimization,
        "min_interval_steps": cb.min_interval_steps,
        "min_release_bytes": cb.min_release_bytes,
        "sample_every": cb.sample_every,
        "pressure_fraction": cb.pressure_fraction,
        "min_reserved_bytes": cb.min_reserved_bytes(),
        "allocator_setup": cb.allocator_setup,
    }
    cb.telemetry.close()
    return out


def run_window(cfg: dict, model, opt, device, name: str) -> dict:
    """``reset`` to the common starting state, then one ``fragmentation_run`` of variant ``name``."""
    reset(model, opt)
    cb = make_callback(cfg, name) if CALLBACK_VARIANTS[name] is not None else None
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


def search_largest(fits, start: int, cap: int) -> int:
    """Largest ``b`` in ``[1, cap]`` with ``fits(b)`` (assumed monotone: true up to a limit), or 0.

    Gallops from ``start`` (up by 1, 2, 4, ... while it fits, down likewise while it does not), then
    bisects the bracket; each ``b`` is probed at most once. From ``start=1`` the upward gallop probes
    exactly the powers of two, as a power-of-two search would.
    """
    if cap < 1:
        raise ValueError(f"cap={cap!r}: expected at least 1")
    seen: dict[int, bool] = {}

    def probe(b: int) -> bool:
        if b not in seen:
            seen[b] = bool(fits(b))
        return seen[b]

    start = min(max(1, start), cap)
    if probe(start):  # fits(lo) holds; hi is the smallest known failure (cap + 1: none known)
        lo, step = start, 1
        while lo + step <= cap and probe(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, cap + 1)
    else:
        hi, step = start, 1
        while hi - step >= 1 and not probe(hi - step):
            hi, step = hi - step, step * 2
        lo = hi - step if hi - step >= 1 else 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo


def try_step(model, opt, device, batch: int, length: int, before_optimizer_step=None) -> bool:
    """One training step at ``batch`` x ``length``; False if the allocator ran out of memory."""
    import torch

    try:
        train_step(model, opt, device, batch, length, model.config.vocab_size, before_optimizer_step)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)


def largest_micro_batch(cfg: dict, model, opt, device) -> int:
    """Largest power-of-two micro-batch at ``search_len`` tokens that trains without OOM (up to a cap),
    each probe from the common starting state (empty cache, no optimizer state)."""
    best, batch = 0, 1
    while batch <= cfg["search_cap"]:
        reset(model, opt)
        fits = try_step(model, opt, device, batch, cfg["search_len"])
        reset(model, opt)
        if not fits:
            break
        best, batch = batch, batch * 2
    return best


def micro_batch_search(cfg: dict, model, opt, device, batch_variants: list[str]) -> dict:
    """The largest micro-batch at ``search_len`` tokens, to one sequence, from an empty cache (``clean``:
    only the parameters and the optimizer state, made by one step at micro-batch 1, are held) and right
    after the fragmenting schedule of each variant in ``batch_variants`` (``after_schedule``).

    A probe after the schedule starts from the common state (``reset``), runs the whole length schedule
    with the variant's callback (or none), then one step at the probed micro-batch with the callback's
    pre-optimizer hook; it never continues from an earlier probe, whose OOM or large step would have
    changed the cache. Its search starts at the clean result, so it usually needs two probes (the
    result and the micro-batch above it), three or four when the schedule lowers it by two or more.
    Each probe records the cache just before the probed step (reserved, fragmentation, inactive split
    bytes, the schedule's compactions) and the allocator retries during it: a retry means the allocator
    had to free its whole cache and cudaMalloc again inside the step.
    """
    import torch

    from rapidfire_hf.memory import sample_memory

    length, cap = cfg["search_len"], cfg["search_cap"]
    clean_probes: list[dict] = []

    def fits_clean(batch: int) -> bool:
        reset(model, opt)
        try_step(model, opt, device, 1, length)  # the optimizer state exists, as after any step...
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # ...and nothing else is cached
        fits = try_step(model, opt, device, batch, length)
        clean_probes.append({"batch": batch, "fits": fits})
        reset(model, opt)
        return fits

    clean = search_largest(fits_clean, 1, cap)
    pow2 = [p["batch"] for p in clean_probes if p["fits"] and p["batch"] & (p["batch"] - 1) == 0]
    out = {
        "search_len": length,
        "search_cap": cap,
        "schedule_steps": cfg["steps"],
        "clean": clean,
        "clean_pow2": max(pow2, default=0),
        "clean_probes": clean_probes,
        "after_schedule": {},
    }
    for name in batch_variants:
        probes: list[dict] = []

        def fits_after(batch: int, name=name, probes=probes) -> bool:
            reset(model, opt)
            cb = make_callback(cfg, name) if CALLBACK_VARIANTS[name] is not None else None
            try:
                window = fragmentation_run(cfg, model, opt, device, cb)
                before = sample_memory()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                pre = TrainerHooks(cb, model, opt).pre_optimizer_step(cfg["steps"] + 1) if cb else None
                fits = try_step(model, opt, device, batch, length, pre)
                after = sample_memory()
            finally:
                if cb is not None:
                    cb.telemetry.close()
                reset(model, opt)
            probes.append(
                {
                    "batch": batch,
                    "fits": fits,
                    "reserved_before": before.reserved,
                    "fragmentation_before": before.fragmentation,
                    "inactive_split_bytes_before": before.inactive_split_bytes,
                    "schedule_compactions": window["compactions"],
                    "schedule_max_reserved": window["max_reserved"],
                    "alloc_retries": (after.num_alloc_retries or 0) - (before.num_alloc_retries or 0),
                    "peak_reserved": after.peak_reserved,
                }
            )
            return fits

        largest = search_largest(fits_after, max(clean, 1), cap)
        out["after_schedule"][name] = {"largest": largest, "probes": probes}
    return out


def scenario_allocator(cfg: dict) -> dict:
    """Fragmentation with and without the callback, under the allocator this process was started with.

    One untimed warm-up pass, then ``cfg["rounds"]`` rounds of ``cfg["variants"]`` in a changing order (see
    the module docstring). Memory numbers and the step trace of a variant are those of its first timed
    window; each window's own numbers are kept under ``rounds``. Then the micro-batch searches
    (``micro_batch_search``) for ``cfg["batch_variants"]``.
    """
    import os

    import torch

    variants = list(cfg.get("variants") or DEFAULT_VARIANTS)
    batch_variants = list(cfg["batch_variants"] if cfg.get("batch_variants") is not None else BATCH_VARIANTS)
    check_variants(variants, batch_variants)
    model, opt, device = build(cfg)
    out = {"alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if torch.cuda.is_available():  # check that the setting took: segments say whether they are expandable
        segments = torch.cuda.memory._snapshot()["segments"]
        out["expandable_segments_seen"] = any(seg.get("is_expandable") for seg in segments)
    out["variants"] = variants
    out["batch_variants"] = batch_variants
    out["callback_settings"] = {
        name: callback_settings(cfg, name)
        for name in dict.fromkeys(variants + batch_variants)
        if CALLBACK_VARIANTS[name] is not None
    }
    # warm-up: the whole schedule, with a compacting callback so its code path is warm too; not timed
    warm = "callback_t0.3"
    out["warmup"] = [
        {"variant": warm, "total_s": run_window(cfg, model, opt, device, warm)["total_s"]}
        for _ in range(cfg["warmup_passes"])
    ]
    orders = round_orders(variants, cfg["rounds"])
    out["rounds"] = cfg["rounds"]
    out["orders"] = orders
    out["orders_balanced"] = cfg["rounds"] % (len(variants) * (1 if len(variants) % 2 == 0 else 2)) == 0
    windows: dict[str, list[dict]] = {name: [] for name in variants}
    for r, order in enumerate(orders):
        for position, name in enumerate(order):
            w = run_window(cfg, model, opt, device, name)
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
    out["micro_batch"] = micro_batch_search(cfg, model, opt, device, batch_variants)
    out["largest_micro_batch"] = out["micro_batch"]["clean_pow2"]  # the power-of-two search of earlier runs
    return out


def check_variants(variants: list[str], batch_variants: list[str]) -> None:
    """Clear errors for unknown or unusable variant lists."""
    for name in variants + batch_variants:
        if name not in CALLBACK_VARIANTS:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(CALLBACK_VARIANTS)}")
    if len(set(variants)) != len(variants) or len(set(batch_variants)) != len(batch_variants):
        raise ValueError("a variant is listed twice")
    if "no_callback" not in variants or len(variants) < 2:
        raise ValueError("the timed variants must include no_callback (the paired baseline) and one more")


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
    import argparse

    parser = argparse.ArgumentParser(description="one scenario of the memory benchmark (run.py starts it)")
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("out_path", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--variants", type=split_names, default=None)
    parser.add_argument("--batch-variants", type=split_names, default=None)
    args = parser.parse_args(argv)
    cfg = setting(args.smoke)
    if args.rounds is not None:
        cfg["rounds"] = args.rounds
    cfg["variants"], cfg["batch_variants"] = args.variants, args.batch_variants
    cfg["out_dir"] = str(args.out_path.parent)
    with smoke_threads(args.smoke):
        result = SCENARIOS[args.scenario](cfg)
    with open(args.out_path, "w") as f:
        json.dump(result, f)


def split_names(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``; ``""`` or ``"none"`` -> ``[]``."""
    return [] if text.strip().lower() in ("", "none") else [t.strip() for t in text.split(",") if t.strip()]


if __name__ == "__main__":
    main(sys.argv[1:])
