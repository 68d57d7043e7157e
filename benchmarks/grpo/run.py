"""Stock ``trl.GRPOTrainer`` against ``enable_rapidfire(GRPOTrainer(...))``, same model, data and seed.

The workload of DESIGN.md: a random-init Llama of the 1.1B shape (hidden 2048, 22 layers, 32 heads,
4 KV heads, vocab 32000) built on the GPU in bf16, 128-token prompts, 8 generations of 256 tokens per
prompt, a rule-based reward (fraction of vowels), beta 0. Each variant runs in its own process (fresh
CUDA allocator, its own peak), for ``--steps`` optimizer steps.

Variants (``--variants``, comma-separated; default all five):

- ``stock``: ``GRPOTrainer`` with TRL's defaults (``optim="adamw_torch_fused"``, ``gradient_checkpointing=True``).
- ``rapidfire``: the same trainer through ``enable_rapidfire(trainer, optimizer_kwargs={"rollback": ...,
  "snapshot": ...})`` (``--rollback``, ``--snapshot``), balanced config.
- ``rapidfire_lowmem``: the memory-saving settings, each listed with its source (stock TRL option or
  rapidfire_hf) under ``results.json`` -> ``variants`` -> ``rapidfire_lowmem``: bitsandbytes' 8-bit AdamW
  as the inner optimizer (``optim="adamw_8bit"``; plain ``adamw_torch`` when bitsandbytes is missing or on
  the CPU, recorded as a fallback), gradient pipeline on with ``gradient_accumulation_steps=1``,
  ``rollback="off"`` (no snapshot), ``memory.optimization: aggressive`` with
  ``apply_selective_checkpointing(model, "aggressive")`` called here (``enable_rapidfire`` does not apply
  checkpointing itself), and the rollout engine's KV cache released after every rollout. Unchanged since
  its first H200 run, so its numbers stay comparable.
- ``rapidfire_lowmem2``: ``rapidfire_lowmem`` plus what README.md ("Where the peak comes from") found
  missing: ``max_grad_norm=0`` so that the gradient pipeline really frees gradients from the first step
  (with clipping on and ``rollback="off"``, RapidFireOptimizer defers every window whose norm history
  says clipping may bind, the first one always, and full gradients are held), chunked checkpointing with
  the layer inputs in pinned host memory (``lowmem.py``; ``--lowmem2-rows`` sequences per chunk, default
  8) instead of full checkpointing, TRL's fused LM head with a narrower vocabulary tile
  (``--lowmem2-lm-head-chunk``, default 4096), and the optimizer state moved to the host during each
  rollout.
- ``rapidfire_lowmem3``: ``rapidfire_lowmem2`` without the optimizer-state round trip (the 8-bit state stays
  on the GPU, the embedding's in 8 bits too unless ``--lowmem3-embedding-32bit``), with the rollout's prompt
  prefill run ``--lowmem3-prefill-rows`` prompts at a time so the rollout fits next to the state, cuBLAS
  workspaces freed after each rollout (each re-recorded decode graph left one behind), and 4 backward / 2
  forward checkpointing chunks (``--lowmem3-rows`` 16, ``--lowmem3-forward-rows`` 32) instead of 8 / 8.
- ``rapidfire_lowmem4``: ``rapidfire_lowmem3`` with the offloaded layer inputs' pinned host buffers kept in a
  pool across steps (``lowmem.HostOffloader(reuse_host_buffers=True)``: every CUDA-graph capture calls
  ``torch._C._host_emptyCache()``, so ``rapidfire_lowmem3`` re-pinned ~2.9 GB in every loss forward) and
  bitsandbytes' per-parameter ``torch.cuda.synchronize()`` skipped on the default stream
  (``lowmem.skip_bitsandbytes_sync_on_default_stream``). Same math as ``rapidfire_lowmem3``. Runs through the
  library: ``enable_rapidfire(config={"memory": {"lowmem": "on_8bit_embedding"}}, lowmem_options=...)``
  (``rapidfire_hf.integrations.lowmem``; ``"on"`` with an explicit torch AdamW in the CPU fallback).

Reported per variant: tokens/s (prompt + completion tokens, TRL's ``num_input_tokens_seen``) over all
steps and over steps 2.. (steady state), labelled, with the first step's time and its excess over the
median later step stated separately (one-time work: compilation, CUDA-graph capture, allocator and
optimizer-state warm-up); generated tokens/s; peak allocated and reserved GiB, overall and per phase of
the step (generation, loss forward, backward, gradient clipping, optimizer step, other), read with
``torch.cuda.max_memory_allocated`` and reset at each phase boundary; time per phase (``time_by_phase``:
host seconds and, on CUDA, the current stream's seconds between the same boundaries, from events, no
added sync); for the low-memory variants the host seconds of the rollout engine call and of what the
benchmark does around it; the loss and reward curves.

Usage:
    python benchmarks/grpo/run.py --out benchmarks/grpo/results/h200/balanced          # GPU, all four, ~5-6 minutes
    python benchmarks/grpo/run.py --out /tmp/grpo-smoke --smoke               # CPU, tiny model, ~2 minutes
    python benchmarks/grpo/run.py --out /tmp/g --variants stock,rapidfire_lowmem2   # GPU, ~3 minutes
    python benchmarks/grpo/run.py --out /tmp/g3 --variants stock,rapidfire_lowmem,rapidfire_lowmem3  # ~3.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

VARIANTS = (
    "stock",
    "rapidfire",
    "rapidfire_lowmem",
    "rapidfire_lowmem2",
    "rapidfire_lowmem3",
    "rapidfire_lowmem4",
)
LOWMEM = ("rapidfire_lowmem", "rapidfire_lowmem2", "rapidfire_lowmem3", "rapidfire_lowmem4")
LOWMEM3_LIKE = ("rapidfire_lowmem3", "rapidfire_lowmem4")  # share the --lowmem3-* options
# what each variant changes, and whether it is an option of stock TRL/transformers or of rapidfire_hf
# (written to results.json; the lowmem optimizer line is completed at run time, see lowmem_settings)
DESCRIPTIONS = {
    "stock": {
        "description": "trl.GRPOTrainer with TRL's defaults (optim adamw_torch_fused, gradient_checkpointing=True)",
        "settings": [],
    },
    "rapidfire": {
        "description": "enable_rapidfire(GRPOTrainer(...)) with the balanced config and the trainer's own "
        "optimizer (adamw_torch_fused) inside RapidFireOptimizer",
        "settings": [],  # filled in main() with the --rollback / --snapshot values
    },
    "rapidfire_lowmem": {
        "description": "enable_rapidfire(GRPOTrainer(...)) tuned for peak memory: 8-bit AdamW inner optimizer, "
        "gradient pipeline with gradient_accumulation_steps=1, no rollback snapshot, full activation "
        "checkpointing applied by rapidfire_hf, rollout KV cache released after each rollout",
        "settings": [],  # filled by lowmem_settings()
    },
    "rapidfire_lowmem2": {
        "description": "rapidfire_lowmem plus: no gradient clipping (max_grad_norm=0) so the gradient pipeline "
        "frees gradients from the first step, chunked activation checkpointing with the layer inputs in "
        "pinned host memory instead of full checkpointing, TRL's fused LM head with a 4096-wide vocabulary "
        "tile, and the optimizer state in host memory during each rollout",
        "settings": [],  # filled by lowmem2_settings()
    },
    "rapidfire_lowmem3": {
        "description": "rapidfire_lowmem2 without the optimizer-state round trip: the 8-bit AdamW state stays on "
        "the GPU (embedding state in 8 bits too), the rollout's prompt prefill runs in row chunks so the "
        "rollout fits next to it, cuBLAS workspaces are freed after each rollout (they leaked one per "
        "re-recorded decode graph), and the chunked checkpointing uses 4 backward / 2 forward chunks "
        "instead of 8 / 8 (fewer, larger kernels)",
        "settings": [],  # filled by lowmem3_settings()
    },
    "rapidfire_lowmem4": {
        "description": "rapidfire_lowmem3 with the pinned host buffers of the offloaded layer inputs kept across "
        "steps (each CUDA-graph capture of the re-recorded decode step empties torch's pinned-memory cache, "
        "so rapidfire_lowmem3 pinned ~2.9 GB again in every loss forward) and bitsandbytes' per-parameter "
        "torch.cuda.synchronize() skipped while the default stream is current (non-paged 8-bit state)",
        "settings": [],  # filled by lowmem4_settings()
    },
}
# rapidfire_lowmem2 defaults (flags --lowmem2-rows, --lowmem2-lm-head-chunk)
LOWMEM2_ROWS = 8
LOWMEM2_LM_HEAD_CHUNK = 4096
# rapidfire_lowmem3 defaults (flags --lowmem3-rows, --lowmem3-forward-rows, --lowmem3-prefill-rows); sized
# with memory_model.py --variants rapidfire_lowmem3 (see README.md, "rapidfire_lowmem3")
LOWMEM3_ROWS = 16
LOWMEM3_FORWARD_ROWS = 32
LOWMEM3_PREFILL_ROWS = 16
FULL = dict(
    hidden=2048,
    layers=22,
    heads=32,
    kv_heads=4,
    intermediate=5632,
    vocab=32000,
    prompt_len=128,
    completion_len=256,
    batch=64,
    steps=10,
)
SMOKE = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=None,
    prompt_len=16,
    completion_len=8,
    batch=16,
    steps=2,
)
GENERATIONS = 8
GIB = 2.0**30


def build_tokenizer(vocab: int | None):
    """The demo's char tokenizer, padded with filler tokens up to ``vocab`` (decoded as ``<|id|>``)."""
    from rapidfire_hf.demo import build_char_tokenizer

    return build_char_tokenizer(vocab)


def prompts(n: int, length: int, seed: int = 0):
    """``n`` prompts of exactly ``length`` characters (= tokens): ``task: <random letters> ->``."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    body = length - len("task:  ->")
    return Dataset.from_dict(
        {
            "prompt": [
                "task: " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(body)) + " ->"
                for _ in range(n)
            ]
        }
    )


def build_model(shape: dict, tok, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidfire_hf.demo.shapes import config_kwargs

    config = LlamaConfig(
        **{**config_kwargs(shape), "vocab_size": shape["vocab"] or len(tok)},
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the host
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16) if device == "cuda" else model


def bnb_unusable(device: str) -> str | None:
    """``None`` when bitsandbytes' 8-bit AdamW can run here, else why it cannot."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    if device != "cuda":
        return "CPU run: bitsandbytes' 8-bit optimizers need a GPU"
    return None


def lowmem_settings(fallback: str | None, keep_rollout_cache: bool) -> list[dict]:
    """What ``rapidfire_lowmem`` sets, each with its source: a stock TRL/transformers option or ours."""
    optim = "adamw_torch" if fallback else "adamw_8bit"
    return [
        {
            "setting": f'GRPOConfig(optim="{optim}")',
            "source": "stock TRL (TrainingArguments.optim)",
            "effect": (
                f"plain torch AdamW: fallback, {fallback}"
                if fallback
                else "bitsandbytes 8-bit AdamW (optim_bits=8; transformers keeps nn.Embedding state in 32 "
                "bits): about 2 bytes of optimizer state per parameter instead of 4 (bf16 AdamW)"
            ),
            "fallback": fallback,
        },
        {
            "setting": "enable_rapidfire wraps that optimizer in RapidFireOptimizer, gradient pipeline on "
            "(config gradient.pipeline: true, the default)",
            "source": "rapidfire_hf",
            "effect": "each bucket of parameters is stepped during backward and its gradients freed; "
            "enable_rapidfire has no optimizer-name option (optimizer_kwargs={'optimizer': ...} collides "
            "with the instance it wraps), so the inner optimizer is chosen with the trainer's own optim",
        },
        {
            "setting": "GRPOConfig(gradient_accumulation_steps=1)",
            "source": "stock TRL (also its default)",
            "effect": "every backward closes an optimizer window, so no gradient outlives its bucket",
        },
        {
            "setting": 'enable_rapidfire(optimizer_kwargs={"rollback": "off"})',
            "source": "rapidfire_hf",
            "effect": "no health checks and no rollback snapshot (a device snapshot is a full copy of "
            "weights + optimizer state; the rapidfire variant keeps a host one)",
        },
        {
            "setting": 'enable_rapidfire(config={"memory": {"optimization": "aggressive"}})',
            "source": "rapidfire_hf",
            "effect": "in enable_rapidfire this only makes MemoryCompactionCallback compact more eagerly; "
            "it does not apply activation checkpointing",
        },
        {
            "setting": 'rapidfire_hf.memory.apply_selective_checkpointing(model, "aggressive"), called by '
            "this benchmark before enable_rapidfire",
            "source": "rapidfire_hf (applied here, not by enable_rapidfire)",
            "effect": '"aggressive" is full checkpointing of every decoder layer (non-reentrant), the same '
            "recompute policy as TRL's default gradient_checkpointing=True that stock uses",
        },
        {
            "setting": 'GRPOConfig(gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": False})',
            "source": "stock TRL",
            "effect": "the Trainer does not put its own checkpointing over ours; TRL re-enables "
            "checkpointing with these kwargs after each rollout, which matches ours",
        },
        {
            "setting": "rollout KV cache kept between rollouts"
            if keep_rollout_cache
            else "RolloutEngine.release() after every rollout (hooked in by this benchmark; "
            "--lowmem-keep-rollout-cache turns it off)",
            "source": "rapidfire_hf (its API, called here)",
            "effect": "the static engine sizes its KV cache exactly batch x (prompt + max_new_tokens), with "
            "no size option; releasing it keeps the cache (about 0.5 GiB at batch 64 x 384 tokens on this "
            "shape) out of the training step's peak, at the cost of re-recording the decode CUDA graphs "
            "at every rollout (on the CPU the engine uses model.generate and holds no cache)",
        },
    ]


def lowmem2_settings(
    fallback: str | None, rows: int, lm_head_chunk: int, keep_rollout_cache: bool
) -> list[dict]:
    """What ``rapidfire_lowmem2`` sets: ``rapidfire_lowmem``'s settings, with what it changes or adds."""
    replaced = ("apply_selective_checkpointing", "GRPOConfig(gradient_checkpointing=False")
    settings = [
        s
        for s in lowmem_settings(fallback, keep_rollout_cache)
        if not any(r in s["setting"] for r in replaced)
    ]
    return settings + [
        {
            "setting": "GRPOConfig(max_grad_norm=0.0)",
            "source": "stock TRL (TrainingArguments.max_grad_norm); differs from stock's 1.0",
            "effect": "no gradient clipping. With clipping and rollback='off', RapidFireOptimizer defers a "
            "window to step() whenever its norm history says clipping may bind (always in the first window, "
            "and in every window of the H200 run: grad norm ~0.97 against max_grad_norm 1.0 and a 2x "
            "headroom), so every gradient of the step is held (2.05 GiB). Without clipping every window is "
            "stepped in backward, a bucket at a time. The update differs from stock's by the clipping only "
            "(Adam's step is nearly invariant to the gradient's scale)",
        },
        {
            "setting": "GRPOConfig(gradient_checkpointing=False)",
            "source": "stock TRL",
            "effect": "HF's checkpointing stays off: the chunked checkpointing below replaces it",
        },
        {
            "setting": f"lowmem.apply_chunked_checkpointing(model, rows={rows}, offload=True), called by this "
            "benchmark before enable_rapidfire",
            "source": "rapidfire_hf benchmark code (benchmarks/grpo/lowmem.py), applied here",
            "effect": "every decoder layer and the final norm keep only their input, in pinned host memory "
            "(copied on a side stream; prefetched back one layer ahead in backward), instead of 2.06 GiB "
            f"of layer inputs on the GPU; backward recomputes and backpropagates {rows} sequences at a time, "
            "so one layer's recomputed activations are those of a chunk, not of all 64 x 384 tokens",
        },
        {
            "setting": f"trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = {lm_head_chunk} (default 32768)",
            "source": "stock TRL (a module constant of its fused LM head, set by this benchmark)",
            "effect": "TRL's chunked log-prob kernel projects 4096 tokens x this many vocabulary entries per "
            "tile: a 32 MiB tile buffer instead of 256 MiB (both in forward and in backward)",
        },
        {
            "setting": "lowmem.OptimizerStateOffload: the optimizer state to pinned host memory before each "
            "rollout and back after it (hooked in by this benchmark)",
            "source": "rapidfire_hf benchmark code (benchmarks/grpo/lowmem.py), applied here",
            "effect": "the rollout's KV cache and prefill run without the 8-bit AdamW state (~2.4 GiB) on the "
            "GPU; the tensors stay the same objects (storage resized to 0 and back), copies are ordered on "
            "the current stream (no host sync)",
        },
    ]


def lowmem3_settings(
    fallback: str | None,
    rows: int,
    forward_rows: int,
    prefill_rows: int,
    lm_head_chunk: int,
    embedding_8bit: bool,
    keep_rollout_cache: bool,
) -> list[dict]:
    """What ``rapidfire_lowmem3`` sets: ``rapidfire_lowmem2``'s settings without the optimizer-state offload,
    with its checkpointing chunks changed, plus the chunked prefill, the workspace release and (default)
    8-bit embedding state. Each says whether it changes the math relative to stock."""
    settings = []
    for s in lowmem2_settings(fallback, rows, lm_head_chunk, keep_rollout_cache):
        if s["setting"].startswith("lowmem.OptimizerStateOffload"):
            continue  # the state stays on the GPU: no host round trip of 2.4 GiB per rollout
        s = dict(s)
        if s["setting"].startswith("lowmem.apply_chunked_checkpointing"):
            s["setting"] = (
                f"lowmem.apply_chunked_checkpointing(model, rows={rows}, forward_rows={forward_rows}, "
                "offload=True), called by this benchmark before enable_rapidfire"
            )
            s["effect"] += (
                f"; the forward (no_grad, saves nothing) runs {forward_rows} sequences per chunk. Math: same "
                "per-row arithmetic as full checkpointing; each chunk's bf16 weight-gradient partial is "
                "rounded once and the partials are summed in fp32 (tests/integrations/test_grpo_lowmem.py)"
            )
        if s["setting"].startswith("GRPOConfig(optim=") and not fallback and embedding_8bit:
            s["setting"] = "bitsandbytes.optim.AdamW8bit through Trainer(optimizer_cls_and_kwargs=...)"
            s["source"] = (
                "stock transformers/bitsandbytes (Trainer.optimizer_cls_and_kwargs, set by this benchmark)"
            )
            s["effect"] = (
                "the same 8-bit AdamW as optim='adamw_8bit' with the trainer's own hyper-parameters and "
                "param groups, but transformers' override that keeps nn.Embedding state in 32 bits is not "
                "registered (it only fires for optim_bits=8 in the kwargs): embed_tokens' state is 8-bit too "
                "(~0.37 GiB less). Math: differs from stock (bf16 AdamW state) as all 8-bit state does, and "
                "from rapidfire_lowmem's for the embedding (its rows without gradient keep zero state)"
            )
        settings.append(s)
    return settings + [
        {
            "setting": f"lowmem.chunk_prefill(engine net, rows={prefill_rows}), hooked in by this benchmark",
            "source": "rapidfire_hf benchmark code (benchmarks/grpo/lowmem.py), applied here",
            "effect": "the rollout's prompt prefill runs that many prompts at a time (its MLP transient over "
            "64 x 128 tokens, ~0.5 GiB, shrinks 4x), so the rollout fits next to the resident 8-bit state. "
            "Math: the same per-row computation (rows are independent); cuBLAS may choose other kernels for "
            "fewer rows, so the prefill's bits can differ as between batch sizes",
        },
        {
            "setting": "torch._C._cuda_clearCublasWorkspaces() after each RolloutEngine.release()",
            "source": "rapidfire_hf benchmark code (lowmem.clear_cublas_workspaces), applied here",
            "effect": "frees the cuBLAS workspace (32 MiB on Hopper) that each re-recorded decode graph's "
            "warm-up stream left behind (+0.031 GiB per step in results/h200/lowmem2). No effect on the math",
        },
    ]


def lowmem4_settings(*args, **kwargs) -> list[dict]:
    """What ``rapidfire_lowmem4`` sets: ``rapidfire_lowmem3``'s settings (same arguments) plus the kept pinned
    buffers and the skipped bitsandbytes syncs (neither changes the math), all applied by the library:
    ``enable_rapidfire(config={"memory": {"lowmem": ...}})`` (``rapidfire_hf.integrations.lowmem``)."""
    library = "rapidfire_hf (enable_rapidfire, config memory.lowmem)"
    settings = []
    for s in lowmem3_settings(*args, **kwargs):
        s = dict(s)
        if s["source"].startswith("rapidfire_hf benchmark code"):
            s["source"] = library
        if s["setting"].startswith("lowmem.apply_chunked_checkpointing"):
            s["setting"] = s["setting"].replace("offload=True", "offload=True, reuse_host_buffers=True")
        if s["setting"].startswith("lowmem."):
            s["setting"] = "rapidfire_hf.integrations." + s["setting"].replace(
                "called by this benchmark before enable_rapidfire", "applied by enable_rapidfire"
            ).replace("hooked in by this benchmark", "applied by enable_rapidfire")
        if s["setting"].startswith("trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE"):
            s["source"] = f"stock TRL (a module constant of its fused LM head, set by {library})"
        if s["setting"].startswith("bitsandbytes.optim.AdamW8bit"):
            s["setting"] = "bitsandbytes.optim.AdamW8bit through Trainer.optimizer_cls_and_kwargs"
            s["source"] = "rapidfire_hf (enable_rapidfire, config memory.lowmem='on_8bit_embedding')"
        if s["setting"].startswith("RolloutEngine.release()"):
            s["setting"] = "RolloutEngine.release() after every rollout (applied by enable_rapidfire)"
            s["source"] = library
        if 'optimizer_kwargs={"rollback": "off"}' in s["setting"]:
            s["effect"] += " (also memory.lowmem's default when optimizer_kwargs leaves rollback unset)"
        settings.append(s)
    return [
        {
            "setting": 'enable_rapidfire(trainer, config={"memory": {"optimization": "aggressive", "lowmem": '
            '"on_8bit_embedding"}}, optimizer_kwargs={"rollback": "off"}, lowmem_options={rows, forward_rows, '
            'prefill_rows, lm_head_chunk}) ("on" with the CPU fallback optimizer, passed explicitly)',
            "source": library,
            "effect": "applies every rapidfire_hf setting below; requires max_grad_norm=0.0 and optim='adamw_8bit' "
            "(or an explicit optimizer) in the GRPOConfig and raises naming them otherwise. Math: see each",
        },
        *settings,
        {
            "setting": "rapidfire_hf.integrations.lowmem.HostOffloader(reuse_host_buffers=True): the pinned host "
            "buffers of the offloaded layer inputs stay in the offloader's pool between steps",
            "source": library,
            "effect": "each CUDA-graph capture (torch.cuda.graph, entered once per rollout because the engine is "
            "released after each) calls torch._C._host_emptyCache(), which gave the ~2.9 GB of cached pinned "
            "blocks back to the driver before every step; rapidfire_lowmem3's loss forward then pinned them again "
            "(23 cudaHostAlloc of 128 MiB). Pooled buffers are in use, so they survive the capture. +2.2 GB of "
            "host memory held for the run. No effect on the math (the same bytes are copied)",
        },
        {
            "setting": "rapidfire_hf.integrations.lowmem.skip_bitsandbytes_sync_on_default_stream(): "
            "bitsandbytes.optim.optimizer.sync_gpu returns without torch.cuda.synchronize() while the current "
            "stream is the default stream (applied when the optimizer is non-paged bitsandbytes)",
            "source": library,
            "effect": "bitsandbytes' step() synchronises the device after every parameter (needed for paged "
            "state only); its 8-bit kernels launch on the default stream, which is the current stream in the "
            "gradient pipeline's hooks, so stream order already covers them. ~200 host syncs a step fewer in "
            "backward. No effect on the math (the same kernels in the same order)",
        },
    ]


def release_rollout_cache_after_each_rollout(
    trainer, state_offload=None, prefill_rows: int | None = None, clear_workspaces: bool = False, timings=None
) -> bool:
    """Make the installed rollout engine drop its KV cache, buffers and graphs after every rollout.

    With ``state_offload`` (an ``OptimizerStateOffload``, ``rapidfire_lowmem2``), the optimizer state is
    also moved to the host before each rollout and back after it. ``rapidfire_lowmem3``: ``prefill_rows``
    chunks the engine's prompt prefill (``lowmem.chunk_prefill``) and ``clear_workspaces`` frees cuBLAS's
    workspaces after each release. ``timings`` (a dict) collects per rollout the host seconds of the
    engine call (it ends with a device sync: the completions are read on the host) and of the
    offload / release / restore around it.
    """
    patch = trainer._rapidfire.parts.get("rollout")
    if patch is None:
        return False
    generate = patch._generate
    times = timings if timings is not None else {}
    for key in ("state_offload_s", "engine_s", "release_s", "state_restore_s", "prefill_chunked_rollouts"):
        times.setdefault(key, [])

    def chunk_prefill_once():
        engine = patch._engine
        net = getattr(getattr(engine, "_static", None), "net", None)
        if prefill_rows is None or net is None:
            return False
        if getattr(net, "_rapidfire_prefill_rows", None) is None:
            from lowmem import chunk_prefill

            chunk_prefill(net, prefill_rows)
        return True

    if prefill_rows is not None:
        engine_for = patch._engine_for

        def engine_for_chunked(model):  # the engine is built at the first rollout: chunk it from there on
            engine = engine_for(model)
            chunk_prefill_once()
            return engine

        patch._engine_for = engine_for_chunked

    def generate_then_release(prompt_ids):
        t0 = time.perf_counter()
        if state_offload is not None:
            state_offload.offload()
        t1 = time.perf_counter()
        try:
            return generate(prompt_ids)
        finally:
            t2 = time.perf_counter()
            times["prefill_chunked_rollouts"].append(chunk_prefill_once())
            if patch._engine is not None:
                patch._engine.release()
            if clear_workspaces:
                from lowmem import clear_cublas_workspaces

                clear_cublas_workspaces()
            t3 = time.perf_counter()
            if state_offload is not None:
                state_offload.restore()
            t4 = time.perf_counter()
            for key, dt in zip(
                ("state_offload_s", "engine_s", "release_s", "state_restore_s"),
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
            ):
                times[key].append(dt)

    patch._generate = generate_then_release
    return True


class PhaseMemory:
    """Peak allocated (and reserved) GPU memory, and time, per phase of the training step.

    Phases: ``generation`` (``_generate_and_score_completions``: rollout, rewards, advantages),
    ``loss_forward`` (``compute_loss``), ``backward`` (``accelerator.backward``; with the gradient
    pipeline this includes the optimizer's bucket steps), ``grad_clip`` (``accelerator.clip_grad_norm_``),
    ``optimizer_step`` (between the Trainer's ``on_pre_optimizer_step`` and ``on_optimizer_step``), and
    ``other`` (everything in between). At each boundary the peak since the last boundary is read
    (``torch.cuda.max_memory_allocated``) and charged to the phase that was running, then the peak is
    reset (``reset_peak_memory_stats``), so the largest phase peak is the process's peak. Side effect:
    anything else reading ``max_memory_allocated`` (``rapidfire/memory/max_allocated_gib``) sees the peak
    since the last boundary only.

    Time: at each boundary the host clock is read (``cpu_s``: host seconds spent in each phase, which
    for asynchronous CUDA work is the time to enqueue it, plus any syncs) and, on CUDA, an event is
    recorded on the current stream (``gpu_s``: the current stream's time between the boundaries, kernels
    plus idle gaps, so the phases add up to the step as the device saw it). No sync is added: the events
    are read at the end of each step, after the step timer's ``synchronize``. On the CPU, memory is not
    measured and ``gpu_s`` is empty.
    """

    PHASES = ("generation", "loss_forward", "backward", "grad_clip", "optimizer_step", "other")

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.current = "other"
        self.stack: list[str] = []
        self.peak = dict.fromkeys(self.PHASES, 0)
        self.reserved = dict.fromkeys(self.PHASES, 0)
        self.at_start = dict.fromkeys(self.PHASES, 0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self.step_peak: dict[str, int] = {}
        self.per_step: list[dict[str, float]] = []
        self.t_last = None  # host clock at the last boundary
        self.ev_last = None  # CUDA event at the last boundary
        self.step_cpu: dict[str, float] = {}
        self.step_events: list[tuple] = []  # (phase, start event, end event) of this step
        self.per_step_time: list[dict] = []

    def _close(self) -> None:
        import time as _time

        now = _time.perf_counter()
        if self.t_last is not None:
            self.step_cpu[self.current] = self.step_cpu.get(self.current, 0.0) + now - self.t_last
        self.t_last = now
        if not self.cuda:
            return
        cuda = self.torch.cuda
        event = cuda.Event(enable_timing=True)
        event.record()
        if self.ev_last is not None:
            self.step_events.append((self.current, self.ev_last, event))
        self.ev_last = event
        peak, reserved = cuda.max_memory_allocated(), cuda.max_memory_reserved()
        name = self.current
        self.peak[name] = max(self.peak[name], peak)
        self.reserved[name] = max(self.reserved[name], reserved)
        self.step_peak[name] = max(self.step_peak.get(name, 0), peak)
        cuda.reset_peak_memory_stats()

    def enter(self, name: str) -> None:
        self._close()
        self.stack.append(self.current)
        self.current = name
        self.calls[name] += 1
        if self.cuda:
            self.at_start[name] = max(self.at_start[name], self.torch.cuda.memory_allocated())

    def exit(self) -> None:
        self._close()
        self.current = self.stack.pop() if self.stack else "other"

    def end_step(self) -> None:
        self._close()
        gpu: dict[str, float] = {}
        if self.cuda:
            self.per_step.append({k: v / GIB for k, v in self.step_peak.items()})
            self.ev_last.synchronize()
            for name, start, end in self.step_events:
                gpu[name] = gpu.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        self.per_step_time.append({"cpu_s": self.step_cpu, "gpu_s": gpu})
        self.step_peak, self.step_cpu, self.step_events = {}, {}, []

    def start(self) -> None:
        """Mark the start of training (the first boundary of the time accounting)."""
        self._close()

    def wrap(self, owner, attr: str, phase: str) -> None:
        import functools

        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            self.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, attr, wrapped)

    def install(self, trainer) -> None:
        from transformers import TrainerCallback

        self.wrap(trainer, "_generate_and_score_completions", "generation")
        self.wrap(trainer, "compute_loss", "loss_forward")
        self.wrap(trainer.accelerator, "backward", "backward")
        self.wrap(trainer.accelerator, "clip_grad_norm_", "grad_clip")
        phases = self

        class Boundaries(TrainerCallback):
            def on_pre_optimizer_step(self, *a, **k):
                phases.enter("optimizer_step")

            def on_optimizer_step(self, *a, **k):
                phases.exit()

            def on_step_end(self, *a, **k):
                phases.end_step()

        trainer.add_callback(Boundaries())

    def overall_peak(self) -> tuple[int, int] | None:
        """(allocated, reserved) peak bytes over all phases (what one unreset reading would give)."""
        if not self.cuda:
            return None
        self._close()
        return max(self.peak.values()), max(self.reserved.values())

    def time_report(self) -> dict:
        """Seconds per phase: per step, and the median over steps 2.. (steady state) of each phase."""
        import statistics

        steady = self.per_step_time[1:]

        def median(kind: str) -> dict[str, float]:
            names = dict.fromkeys(k for step in steady for k in step[kind])
            return {k: statistics.median(step[kind].get(k, 0.0) for step in steady) for k in names}

        return {
            "per_step": self.per_step_time,
            "median_steps_2_on": {"cpu_s": median("cpu_s"), "gpu_s": median("gpu_s")} if steady else None,
            "note": "cpu_s: host seconds in each phase (enqueueing asynchronous work, plus syncs); gpu_s: "
            "the current CUDA stream's time between the phase boundaries (kernels plus idle gaps; sums to "
            "about the step). 'other' includes the dataloader, logging, zero_grad, the scheduler and the "
            "time between steps (its first step also the time before the first boundary).",
        }

    def report(self) -> dict:
        gib = (lambda d: {k: v / GIB for k, v in d.items()}) if self.cuda else (lambda d: None)
        return {
            "peak_allocated_gib": gib(self.peak),
            "peak_reserved_gib": gib(self.reserved),
            "allocated_at_phase_start_gib": gib(self.at_start),
            "peak_allocated_gib_per_step": self.per_step if self.cuda else None,
            "calls": dict(self.calls),
            "note": "peak charged to the phase running when it happened; backward includes the gradient "
            "pipeline's bucket steps; other = dataloader, logging, zero_grad, scheduler",
        }


def speed(step_s: list[float], step_tokens: list[int]) -> dict:
    """Tokens/s over all steps and over steps 2.. (steady state), and the first step's one-time cost."""
    import statistics

    n = len(step_s)
    out = {
        "all_steps": {
            "steps": n,
            "tokens": sum(step_tokens),
            "seconds": sum(step_s),
            "tokens_per_sec": sum(step_tokens) / max(sum(step_s), 1e-9),
        },
        "steady_state_steps_2_on": None,
        "first_step_s": step_s[0] if step_s else None,
        "median_step_s_steps_2_on": None,
        "first_step_excess_s": None,
    }
    if n > 1:
        rest = step_s[1:]
        median = statistics.median(rest)
        out["steady_state_steps_2_on"] = {
            "steps": n - 1,
            "tokens": sum(step_tokens[1:]),
            "seconds": sum(rest),
            "tokens_per_sec": sum(step_tokens[1:]) / max(sum(rest), 1e-9),
        }
        out["median_step_s_steps_2_on"] = median
        out["first_step_excess_s"] = step_s[0] - median  # compile, graph capture, warm-up: paid once
    return out


def run_variant(
    variant: str,
    smoke: bool,
    steps: int,
    out: Path,
    optimizer_kwargs: dict,
    keep_rollout_cache: bool = False,
    lowmem2: dict | None = None,
    lowmem3: dict | None = None,
) -> dict:
    """Train one variant in this process and return its measurements."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import vowel_reward

    lowmem2 = dict(dict(rows=LOWMEM2_ROWS, lm_head_chunk=LOWMEM2_LM_HEAD_CHUNK), **(lowmem2 or {}))
    lowmem3 = dict(
        dict(
            rows=LOWMEM3_ROWS,
            forward_rows=LOWMEM3_FORWARD_ROWS,
            prefill_rows=LOWMEM3_PREFILL_ROWS,
            lm_head_chunk=LOWMEM2_LM_HEAD_CHUNK,
            embedding_8bit=True,
        ),
        **(lowmem3 or {}),
    )
    shape = dict(SMOKE if smoke else FULL, steps=steps)
    device = "cpu" if smoke else "cuda"
    tok = build_tokenizer(shape["vocab"])
    model = build_model(shape, tok, device)
    lowmem = variant in LOWMEM
    v2 = variant == "rapidfire_lowmem2"
    v3 = variant in LOWMEM3_LIKE
    v4 = variant == "rapidfire_lowmem4"
    fallback = bnb_unusable(device) if lowmem else None
    extra = {}
    if lowmem:
        extra = dict(
            optim="adamw_torch" if fallback else "adamw_8bit",
            gradient_accumulation_steps=1,
            gradient_checkpointing=False,  # ours is applied below; the Trainer must not add its own
            gradient_checkpointing_kwargs={"use_reentrant": False},  # what TRL re-enables after a rollout
        )
    if v2 or v3:
        extra["max_grad_norm"] = 0.0  # see lowmem2_settings: clipping keeps the pipeline from freeing grads
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"grpo-{variant}-"),  # nothing is saved; keep --out clean
        max_steps=steps,
        per_device_train_batch_size=shape["batch"],
        num_generations=GENERATIONS,
        max_completion_length=shape["completion_len"],
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        bf16=not smoke,
        use_cpu=smoke,
        beta=0.0,
        **extra,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompts(shape["batch"] * steps, shape["prompt_len"]),
        processing_class=tok,
    )
    embedding_8bit = None
    if v3 and not v4 and not fallback and lowmem3["embedding_8bit"]:
        try:
            embedding_8bit = use_8bit_embedding_state(trainer)
        except Exception as exc:  # another transformers/bitsandbytes API: run on with the 32-bit override
            embedding_8bit = {"error": repr(exc)}
            print(f"rapidfire_lowmem3: 8-bit embedding state not set up ({exc!r})", file=sys.stderr)
    checkpointing = released = offloader = state_offload = None
    bnb_sync_skipped = False
    rollout_times: dict = {}
    if variant == "rapidfire":
        from rapidfire_hf import enable_rapidfire

        trainer = enable_rapidfire(trainer, optimizer_kwargs=optimizer_kwargs)
    elif lowmem:
        from rapidfire_hf import enable_rapidfire

        sys.path.insert(0, str(Path(__file__).resolve().parent))  # lowmem.py, also for the rollout hooks
        if v2:
            import trl.trainer.utils as trl_utils
            from lowmem import OptimizerStateOffload, apply_chunked_checkpointing

            # read by TRL's fused LM head at every call (the vocabulary width of one projection tile)
            trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = lowmem2["lm_head_chunk"]
            offloader = apply_chunked_checkpointing(trainer.model, rows=lowmem2["rows"], offload=True)
            checkpointing = f"chunked, {lowmem2['rows']} sequences per chunk, inputs offloaded to the host"
        elif v4:
            checkpointing = (
                f"chunked, {lowmem3['rows']} sequences per backward chunk, {lowmem3['forward_rows']} per "
                "forward chunk, inputs offloaded to the host"
            )
        elif v3:
            import trl.trainer.utils as trl_utils
            from lowmem import apply_chunked_checkpointing

            trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = lowmem3["lm_head_chunk"]
            offloader = apply_chunked_checkpointing(
                trainer.model,
                rows=lowmem3["rows"],
                forward_rows=lowmem3["forward_rows"],
                offload=True,
            )
            checkpointing = (
                f"chunked, {lowmem3['rows']} sequences per backward chunk, {lowmem3['forward_rows']} per "
                "forward chunk, inputs offloaded to the host"
            )
        else:
            from rapidfire_hf.memory import apply_selective_checkpointing

            # enable_rapidfire does not apply checkpointing itself (memory.optimization only sets compaction)
            checkpointing = apply_selective_checkpointing(trainer.model, "aggressive")
        if v4:
            # the library path: everything of rapidfire_lowmem3/4 that is not a TrainingArguments option comes
            # from config memory.lowmem (rapidfire_hf.integrations.lowmem.install_lowmem)
            mode = "on_8bit_embedding" if not fallback and lowmem3["embedding_8bit"] else "on"
            if fallback:
                # memory.lowmem='on' needs an 8-bit optim or an optimizer chosen explicitly: the CPU fallback
                # chooses the very AdamW that optim="adamw_torch" builds
                trainer.optimizer_cls_and_kwargs = trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
            trainer = enable_rapidfire(
                trainer,
                config={"memory": {"optimization": "aggressive", "lowmem": mode}},
                optimizer_kwargs={"rollback": "off"},
                lowmem_options={
                    k: lowmem3[k] for k in ("rows", "forward_rows", "prefill_rows", "lm_head_chunk")
                },
            )
            parts = trainer._rapidfire.parts["lowmem"]
            offloader, bnb_sync_skipped, embedding_8bit = (
                parts.offloader,
                parts.bnb_sync_skipped,
                parts.embedding_8bit,
            )
            patch = trainer._rapidfire.parts.get("rollout")
            released = patch is not None and patch.release_after_rollout
            rollout_times = patch.timings if patch is not None else {}
            if keep_rollout_cache:
                print("rapidfire_lowmem4: memory.lowmem always releases the rollout engine", file=sys.stderr)
        else:
            trainer = enable_rapidfire(
                trainer,
                config={"memory": {"optimization": "aggressive"}},
                optimizer_kwargs={"rollback": "off"},
            )
        if v2:
            # the optimizer exists only once train() starts: the offloader reads trainer.optimizer then
            state_offload = _LazyStateOffload(trainer, OptimizerStateOffload, include_cpu=smoke)
            state_offload.install_wait(trainer.accelerator)
        if not v4:
            released = (
                False
                if keep_rollout_cache
                else release_rollout_cache_after_each_rollout(
                    trainer,
                    state_offload=state_offload,
                    prefill_rows=lowmem3["prefill_rows"] if v3 else None,
                    clear_workspaces=v3,
                    timings=rollout_times,
                )
            )
    step_times: list[float] = []
    step_tokens: list[int] = []
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        seen = 0

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t)
            step_tokens.append(state.num_input_tokens_seen - self.seen)
            self.seen = state.num_input_tokens_seen

    trainer.add_callback(StepTimer())
    phases = PhaseMemory()
    phases.install(trainer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    phases.start()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    tokens = trainer.state.num_input_tokens_seen
    per_step_tokens = tokens / max(len(step_times), 1)
    generated = sum(h["completions/mean_length"] * shape["batch"] for h in logs)
    peaks = phases.overall_peak()
    result = {
        "variant": variant,
        "steps": len(step_times),
        "wall_s": wall,
        "step_s": step_times,
        "step_tokens": step_tokens,
        "tokens": tokens,
        # kept as before (comparable with earlier results): tokens over the wall time of train(), and
        # steps 2.. with the average tokens per step; "speed" has both spans with exact per-step tokens
        "tokens_per_sec": tokens / wall,
        "tokens_per_sec_after_first_step": per_step_tokens
        * (len(step_times) - 1)
        / max(sum(step_times[1:]), 1e-9),
        "speed": speed(step_times, step_tokens),
        "generated_tokens_per_sec": generated / wall,
        "loss": [h["loss"] for h in logs],
        "reward": [h["reward"] for h in logs],
        "peak_allocated_gib": peaks[0] / GIB if peaks else None,
        "peak_reserved_gib": peaks[1] / GIB if peaks else None,
        "memory_by_phase": phases.report(),
        "time_by_phase": phases.time_report(),
    }
    if variant != "stock":
        state = trainer._rapidfire
        result["installed"], result["skipped"] = state.installed, state.skipped
        result["rapidfire_metrics"] = {k: v for k, v in logs[-1].items() if k.startswith("rapidfire/")}
    if lowmem:
        from rapidfire_hf.integrations.parts import find_rapidfire_optimizer

        rf_opt = find_rapidfire_optimizer(trainer.optimizer)
        inner = rf_opt.inner
        result["lowmem"] = {
            "optim": args.optim.value if hasattr(args.optim, "value") else str(args.optim),
            "inner_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
            "optimizer_fallback": fallback,  # None: the 8-bit optimizer ran
            "rollback": rf_opt.rollback,
            "max_grad_norm": args.max_grad_norm,
            "gradient_pipeline": bool(trainer._rapidfire.pipeline),
            # pipelined_steps: windows stepped in backward (gradients freed); deferred_steps: why not
            "optimizer_stats": {
                k: v
                for k, v in rf_opt.stats().items()
                if k in ("steps", "pipelined_steps", "deferred_steps", "bucket_steps", "pipeline_buckets")
            },
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "checkpointing_applied": checkpointing,  # apply_selective_checkpointing's answer, or ours
            "checkpointing_on_after_training": bool(
                getattr(trainer.model, "is_gradient_checkpointing", False)
            ),
            "rollout_cache_released_after_each_rollout": released,
            "rollout": trainer._rapidfire.parts["rollout"].stats()
            if "rollout" in trainer._rapidfire.parts
            else None,
        }
        result["lowmem"]["rollout_hook_seconds"] = rollout_times  # per rollout, host clock
        if v2:
            result["lowmem"].update(
                chunk_rows=lowmem2["rows"],
                lm_head_vocab_tile=lowmem2["lm_head_chunk"],
                activation_offload=offloader.stats.as_dict(),
                optimizer_state_offload=state_offload.stats() if state_offload is not None else None,
            )
        if v3:
            result["lowmem"].update(
                chunk_rows=lowmem3["rows"],
                forward_chunk_rows=lowmem3["forward_rows"],
                prefill_rows=lowmem3["prefill_rows"],
                lm_head_vocab_tile=lowmem3["lm_head_chunk"],
                activation_offload=offloader.stats.as_dict(),
                embedding_8bit_requested=lowmem3["embedding_8bit"],
                embedding_8bit_optimizer=embedding_8bit,
                optimizer_state_gib=state_gib(inner),
                embedding_state_dtypes=embedding_state_dtypes(trainer.model, inner),
            )
        if v4:
            result["lowmem"].update(
                memory_lowmem=trainer._rapidfire.config.memory.lowmem.value,  # the library option that ran
                reuse_host_buffers=True,
                host_buffer_pool_gib=offloader.pooled_bytes() / GIB,
                bnb_sync_skipped_on_default_stream=bnb_sync_skipped,
                inner_optimizer_paged=bool(getattr(inner, "is_paged", False)),
            )
    result["host_memory"] = host_memory_stats()
    return result


def host_memory_stats() -> dict | None:
    """torch's pinned host allocator over the run (CUDA only): blocks created / returned to the driver and the
    seconds spent doing it. ``rapidfire_lowmem3`` re-pins its offload buffers every step because each CUDA-graph
    capture empties this cache (``num_host_alloc`` ~ 23 x steps); ``rapidfire_lowmem4`` should show 23."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        stats = torch.cuda.memory.host_memory_stats()
    except Exception as exc:  # an older torch without the call
        return {"error": repr(exc)}
    out = {k: stats.get(k) for k in ("num_host_alloc", "num_host_free")}
    for key in ("host_alloc_time.total", "host_free_time.total"):  # microseconds in torch
        if stats.get(key) is not None:
            out[key.replace(".total", "_s")] = stats[key] / 1e6
    for key in ("allocated_bytes.current", "allocated_bytes.peak"):
        if stats.get(key) is not None:
            out[key.replace(".", "_").replace("bytes", "gib")] = stats[key] / GIB
    return out


def use_8bit_embedding_state(trainer) -> dict:
    """``rapidfire_hf.integrations.lowmem.use_8bit_embedding_state`` (moved there; ``rapidfire_lowmem3`` calls it
    here, ``rapidfire_lowmem4`` through ``memory.lowmem='on_8bit_embedding'``)."""
    from rapidfire_hf.integrations.lowmem import use_8bit_embedding_state as impl

    return impl(trainer)


def state_gib(optimizer) -> float:
    """GiB of the optimizer's state tensors (each storage once)."""
    seen = {}
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage") and v.device.type != "meta":
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) / GIB


def embedding_state_dtypes(model, optimizer) -> dict:
    """dtype of each state tensor of the input embedding's weight (uint8 moments: 8-bit state)."""
    weight = model.get_input_embeddings().weight
    state = optimizer.state.get(weight, {})
    return {k: str(v.dtype).replace("torch.", "") for k, v in state.items() if hasattr(v, "dtype")}


class _LazyStateOffload:
    """``OptimizerStateOffload`` of ``trainer.optimizer``, built at the first rollout (after create_optimizer)."""

    def __init__(self, trainer, cls, include_cpu: bool):
        self.trainer, self.cls, self.include_cpu = trainer, cls, include_cpu
        self.impl = None
        self.moved: list[int] = []

    def offload(self) -> None:
        if self.impl is None and self.trainer.optimizer is not None:
            self.impl = self.cls(self.trainer.optimizer, include_cpu=self.include_cpu)
        if self.impl is not None:
            self.moved.append(self.impl.offload())

    def restore(self) -> None:
        if self.impl is not None:
            self.impl.restore()

    def wait(self) -> None:
        if self.impl is not None:
            self.impl.wait()

    def install_wait(self, accelerator) -> None:
        """The restored state must be complete before backward, where the pipeline steps buckets."""
        backward = accelerator.backward

        def backward_after_restore(*args, **kwargs):
            self.wait()
            return backward(*args, **kwargs)

        accelerator.backward = backward_after_restore

    def stats(self) -> dict:
        return {
            "rollouts": len(self.moved),
            "gib_per_rollout": [m / GIB for m in self.moved],
            "storages_not_movable": self.impl.skipped if self.impl is not None else 0,
        }


def environment(smoke: bool) -> dict:
    import accelerate
    import torch
    import transformers
    import trl

    import rapidfire_hf

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "device": "cpu (smoke)" if smoke else gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "rapidfire_hf": rapidfire_hf.__version__,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = results["runs"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 8))
    names = list(runs)
    palette = {
        "stock": "tab:gray",
        "rapidfire": "tab:red",
        "rapidfire_lowmem": "tab:blue",
        "rapidfire_lowmem2": "tab:purple",
        "rapidfire_lowmem3": "tab:green",
        "rapidfire_lowmem4": "tab:orange",
    }
    colors = [palette.get(n, "tab:olive") for n in names]
    x = np.arange(len(names))
    spans = (("all_steps", "all steps", 0.55), ("steady_state_steps_2_on", "steps 2.. (steady state)", 1.0))
    for i, (key, label, alpha) in enumerate(spans):
        vals = [(runs[n]["speed"][key] or {}).get("tokens_per_sec", 0.0) for n in names]
        bars = axes[0, 0].bar(x + (i - 0.5) * 0.4, vals, 0.4, color=colors, alpha=alpha, label=label)
        axes[0, 0].bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=7)
    axes[0, 0].set_xticks(x, names)
    axes[0, 0].set_title("tokens / s (prompt + completion): all steps (light), steps 2.. (dark)")
    mem = [runs[n]["peak_allocated_gib"] or 0.0 for n in names]
    bars = axes[0, 1].bar(names, mem, color=colors)
    half = None
    if any(mem):
        axes[0, 1].bar_label(bars, labels=[f"{v:.2f}" for v in mem])
        if "stock" in runs and runs["stock"]["peak_allocated_gib"]:
            half = runs["stock"]["peak_allocated_gib"] / 2
            axes[0, 1].axhline(half, color="k", ls="--", lw=1, label="1/2 of stock")
            axes[0, 1].legend()
    axes[0, 1].set_title("peak allocated GiB" + (" (n/a on CPU)" if not any(mem) else ""))
    shown = ("generation", "loss_forward", "backward", "optimizer_step")
    width = 0.8 / len(shown)
    for j, phase in enumerate(shown):
        vals = [(runs[n]["memory_by_phase"]["peak_allocated_gib"] or {}).get(phase, 0.0) for n in names]
        axes[0, 2].bar(x + (j - (len(shown) - 1) / 2) * width, vals, width, label=phase)
    if half:
        axes[0, 2].axhline(half, color="k", ls="--", lw=1)
    axes[0, 2].set_xticks(x, names)
    axes[0, 2].legend(fontsize=8)
    axes[0, 2].set_title("peak allocated GiB by phase" + (" (n/a on CPU)" if not any(mem) else ""))
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=8)
    for key, ax in (("loss", axes[1, 0]), ("reward", axes[1, 1]), ("step_s", axes[1, 2])):
        for n, c in zip(names, colors):
            ax.plot(range(1, len(runs[n][key]) + 1), runs[n][key], marker="o", label=n, color=c)
        ax.set_title("step time (s)" if key == "step_s" else key)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[1, 2].set_yscale("log")
    fig.suptitle(f"GRPO, {results['workload']} on {results['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios_to_stock(run: dict, stock: dict) -> dict:
    def tps(r, key):
        span = r["speed"][key]
        return span["tokens_per_sec"] if span else None

    def ratio(a, b):
        return a / b if a and b else None

    out = {
        # as before: over the wall time of train(), and steps 2.. with the average tokens per step
        "tokens_per_sec": run["tokens_per_sec"] / stock["tokens_per_sec"],
        "tokens_per_sec_after_first_step": run["tokens_per_sec_after_first_step"]
        / stock["tokens_per_sec_after_first_step"],
        # exact per-step tokens over the summed step times
        "tokens_per_sec_all_steps": ratio(tps(run, "all_steps"), tps(stock, "all_steps")),
        "tokens_per_sec_steady_state_steps_2_on": ratio(
            tps(run, "steady_state_steps_2_on"), tps(stock, "steady_state_steps_2_on")
        ),
        "peak_allocated": ratio(run["peak_allocated_gib"], stock["peak_allocated_gib"]),
    }
    out["target_met"] = {
        "speed_steady_state_ge_3x": None
        if out["tokens_per_sec_steady_state_steps_2_on"] is None
        else out["tokens_per_sec_steady_state_steps_2_on"] >= 3,
        "speed_all_steps_ge_3x": None
        if out["tokens_per_sec_all_steps"] is None
        else out["tokens_per_sec_all_steps"] >= 3,
        "peak_allocated_le_half": None if out["peak_allocated"] is None else out["peak_allocated"] <= 0.5,
    }
    return out


def summary_lines(runs: dict, by_variant: dict) -> list[str]:
    """One block of plain text per variant: speed over both spans, first step, memory by phase."""
    lines = []
    for name, run in runs.items():
        sp = run["speed"]
        steady = sp["steady_state_steps_2_on"]
        lines.append(
            f"{name}: {sp['all_steps']['tokens_per_sec']:,.0f} tok/s over all {sp['all_steps']['steps']} steps; "
            + (f"{steady['tokens_per_sec']:,.0f} tok/s over steps 2.. (steady state); " if steady else "")
            + f"first step {sp['first_step_s']:.1f} s"
            + (
                f" ({sp['first_step_excess_s']:+.1f} s vs the median later step {sp['median_step_s_steps_2_on']:.2f} s)"
                if steady
                else ""
            )
        )
        times = (run.get("time_by_phase") or {}).get("median_steps_2_on")
        if times:
            kind = "gpu_s" if times["gpu_s"] else "cpu_s"
            lines.append(
                f"  median time per phase, steps 2.. ({'device stream' if kind == 'gpu_s' else 'host'} s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in times[kind].items())
            )
        phases = run["memory_by_phase"]["peak_allocated_gib"]
        if run["peak_allocated_gib"] is not None:
            lines.append(
                f"  peak allocated {run['peak_allocated_gib']:.2f} GiB (reserved {run['peak_reserved_gib']:.2f}); "
                + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
            )
        if name in by_variant:
            r = by_variant[name]
            lines.append(
                "  vs stock: "
                + ", ".join(
                    f"{k} {v:.2f}x" if isinstance(v, float) else f"{k} n/a"
                    for k, v in r.items()
                    if k
                    in (
                        "tokens_per_sec_all_steps",
                        "tokens_per_sec_steady_state_steps_2_on",
                        "peak_allocated",
                    )
                )
                + f"; target met: {r['target_met']}"
            )
    return lines


def lowmem3_options(args) -> dict:
    """The ``rapidfire_lowmem3`` settings from the command line (checked: chunk sizes are ints >= 1)."""
    for flag in ("lowmem3_rows", "lowmem3_forward_rows", "lowmem3_prefill_rows"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return dict(
        rows=args.lowmem3_rows,
        forward_rows=args.lowmem3_forward_rows,
        prefill_rows=args.lowmem3_prefill_rows,
        lm_head_chunk=args.lowmem2_lm_head_chunk,
        embedding_8bit=not args.lowmem3_embedding_32bit,
    )


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and chart.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=list(VARIANTS),
        help=f"comma-separated variants to run, in order (default: {','.join(VARIANTS)})",
    )
    parser.add_argument(
        "--rollback", choices=("auto", "off"), default="auto", help="RapidFireOptimizer rollback (rapidfire)"
    )
    # default host: a device snapshot of weights + Adam state adds about 3x the weights to the GPU peak
    parser.add_argument(
        "--snapshot",
        choices=("device", "host"),
        default="host",
        help="where rollback snapshots live (rapidfire)",
    )
    parser.add_argument(
        "--lowmem-keep-rollout-cache",
        action="store_true",
        help="rapidfire_lowmem: keep the rollout engine's KV cache between rollouts (default: release it)",
    )
    parser.add_argument(
        "--lowmem2-rows",
        type=int,
        default=LOWMEM2_ROWS,
        help=f"rapidfire_lowmem2: sequences per checkpointing chunk (default {LOWMEM2_ROWS})",
    )
    parser.add_argument(
        "--lowmem2-lm-head-chunk",
        type=int,
        default=LOWMEM2_LM_HEAD_CHUNK,
        help=f"rapidfire_lowmem2: vocabulary width of TRL's fused LM head tile (default {LOWMEM2_LM_HEAD_CHUNK})",
    )
    parser.add_argument(
        "--lowmem3-rows",
        type=int,
        default=LOWMEM3_ROWS,
        help=f"rapidfire_lowmem3: sequences per backward checkpointing chunk (default {LOWMEM3_ROWS})",
    )
    parser.add_argument(
        "--lowmem3-forward-rows",
        type=int,
        default=LOWMEM3_FORWARD_ROWS,
        help=f"rapidfire_lowmem3: sequences per forward chunk (default {LOWMEM3_FORWARD_ROWS})",
    )
    parser.add_argument(
        "--lowmem3-prefill-rows",
        type=int,
        default=LOWMEM3_PREFILL_ROWS,
        help=f"rapidfire_lowmem3: prompts per rollout prefill chunk (default {LOWMEM3_PREFILL_ROWS})",
    )
    parser.add_argument(
        "--lowmem3-embedding-32bit",
        action="store_true",
        help="rapidfire_lowmem3: keep transformers' 32-bit optimizer state for the embedding (default: 8-bit)",
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    steps = args.steps or shape["steps"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.variant:
        optimizer_kwargs = {"rollback": args.rollback, "snapshot": args.snapshot}
        result = run_variant(
            args.variant,
            args.smoke,
            steps,
            args.out,
            optimizer_kwargs,
            args.lowmem_keep_rollout_cache,
            dict(rows=args.lowmem2_rows, lm_head_chunk=args.lowmem2_lm_head_chunk),
            lowmem3_options(args),
        )
        (args.out / f"{args.variant}.json").write_text(json.dumps(result, indent=2))
        return
    runs = {}
    for variant in args.variants:
        cmd = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--steps",
            str(steps),
            "--variant",
            variant,
            "--rollback",
            args.rollback,
            "--snapshot",
            args.snapshot,
            "--lowmem2-rows",
            str(args.lowmem2_rows),
            "--lowmem2-lm-head-chunk",
            str(args.lowmem2_lm_head_chunk),
            "--lowmem3-rows",
            str(args.lowmem3_rows),
            "--lowmem3-forward-rows",
            str(args.lowmem3_forward_rows),
            "--lowmem3-prefill-rows",
            str(args.lowmem3_prefill_rows),
        ]
        cmd += ["--lowmem3-embedding-32bit"] if args.lowmem3_embedding_32bit else []
        cmd += ["--lowmem-keep-rollout-cache"] if args.lowmem_keep_rollout_cache else []
        subprocess.run(cmd + (["--smoke"] if args.smoke else []), check=True, env=os.environ.copy())
        runs[variant] = json.loads((args.out / f"{variant}.json").read_text())
    variants = {}
    for name in runs:
        info = dict(DESCRIPTIONS[name])
        if name == "rapidfire":
            info["settings"] = [
                {
                    "setting": f'enable_rapidfire(optimizer_kwargs={{"rollback": "{args.rollback}", '
                    f'"snapshot": "{args.snapshot}"}})',
                    "source": "rapidfire_hf",
                }
            ]
        elif name == "rapidfire_lowmem":
            info["settings"] = lowmem_settings(
                runs[name]["lowmem"]["optimizer_fallback"], args.lowmem_keep_rollout_cache
            )
        elif name == "rapidfire_lowmem2":
            info["settings"] = lowmem2_settings(
                runs[name]["lowmem"]["optimizer_fallback"],
                args.lowmem2_rows,
                args.lowmem2_lm_head_chunk,
                args.lowmem_keep_rollout_cache,
            )
        elif name in LOWMEM3_LIKE:
            o = lowmem3_options(args)
            make = lowmem3_settings if name == "rapidfire_lowmem3" else lowmem4_settings
            info["settings"] = make(
                runs[name]["lowmem"]["optimizer_fallback"],
                o["rows"],
                o["forward_rows"],
                o["prefill_rows"],
                o["lm_head_chunk"],
                o["embedding_8bit"],
                args.lowmem_keep_rollout_cache,
            )
        variants[name] = info
    stock = runs.get("stock")
    by_variant = {n: ratios_to_stock(r, stock) for n, r in runs.items() if n != "stock"} if stock else {}
    results = {
        "command": " ".join(
            [Path(sys.executable).name, "benchmarks/grpo/run.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(args.smoke),
        "workload": (
            f"Llama hidden {shape['hidden']} x {shape['layers']} layers, {shape['prompt_len']}-token prompts, "
            f"{GENERATIONS} x {shape['completion_len']} completion tokens, batch {shape['batch']}"
        ),
        "rapidfire_optimizer": {"rollback": args.rollback, "snapshot": args.snapshot},
        "variants": variants,
        "runs": runs,
        # rapidfire / stock, as before; every variant / stock in ratios_by_variant
        "ratios": by_variant.get("rapidfire"),
        "ratios_by_variant": by_variant,
        "target": "tokens_per_sec ratio >= 3 and peak_allocated ratio <= 0.5 (vs stock); the speed ratio is "
        "given over all steps and over steps 2.. (steady state, without the one-time first-step work)",
    }
    results["summary"] = summary_lines(runs, by_variant)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "chart.png")
    print("\n".join(results["summary"]))
    print(json.dumps({"ratios_by_variant": by_variant, "out": str(args.out)}, indent=2))


if __name__ == "__main__":
    main()
