"""Static fp16 vs adaptive precision on a small Llama with one layer that overflows fp16.

The overflow is constructed, and said so in the results: layer 1's MLP down-projection weights are scaled
so that its output peaks at ~4x the fp16 maximum (65504) on the first batch. fp32 trains normally (RMSNorm
renormalises the residual stream); static fp16 with ``torch.amp.GradScaler`` gets a non-finite loss on
every step and skips every update; the adaptive plugin finds the layer in its sensitivity pass, runs it in
fp32 and trains like fp32 with the rest in fp16.
"""

from __future__ import annotations

import time

import torch

from rapidfire_hf.precision import AdaptivePrecisionPlugin

TARGET_PEAK = 4 * 65504.0


def _batches(n: int, batch: int, seq: int, vocab: int, device, seed: int = 0):
    """A learnable stream: each sequence counts up by a random stride from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(4, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        ids = 4 + (start + stride * torch.arange(seq)) % (vocab - 4)
        yield {"input_ids": ids.to(device)}


def _model(cfg: dict, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden"],
        intermediate_size=2 * cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    model = LlamaForCausalLM(config).to(device)
    batch = next(_batches(1, 4, cfg["max_position_embeddings"], cfg["vocab_size"], device))
    down = model.model.layers[1].mlp.down_proj
    peak = {}
    handle = down.register_forward_hook(lambda m, i, o: peak.setdefault("v", o.detach().abs().max().item()))
    with torch.no_grad():
        model(**batch)
        handle.remove()
        down.weight.mul_(TARGET_PEAK / peak["v"])
    return model


def _run(mode: str, cfg: dict, steps: int, batch: int, lr: float, device) -> dict:
    model = _model(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    plugin = scaler = None
    if mode == "adaptive_fp16":
        plugin = AdaptivePrecisionPlugin(initial="fp16", fallback=None).attach(model=model, optimizer=opt)
    elif mode == "static_fp16":
        scaler = torch.amp.GradScaler(device.type)
    losses, skipped = [], 0
    t0 = time.perf_counter()
    data = _batches(steps, batch, cfg["max_position_embeddings"], cfg["vocab_size"], device, seed=1)
    for step, b in enumerate(data, start=1):
        if plugin is not None and step == 1:
            plugin.calibrate(b)
        ctx = torch.autocast(device.type, dtype=torch.float16, enabled=mode != "fp32")
        with ctx:
            loss = model(**b, labels=b["input_ids"]).loss
        if plugin is not None:
            plugin.backward(loss)
            plugin.step()
            plugin.on_step_end(step, {"loss": loss.detach()})
        elif scaler is not None:
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    out = {
        "mode": mode,
        "loss": losses,
        "final_loss": losses[-1],
        "nonfinite_loss_steps": sum(not torch.isfinite(torch.tensor(v)).item() for v in losses),
        "seconds": seconds,
        "skipped_updates": skipped,
    }
    if plugin is not None:
        out["skipped_updates"] = max(plugin.scaler.overflow_counts)
        out["stats"] = plugin.stats()
        out["switches"] = [str(a) for a in plugin.history]
        out["sensitivity"] = [vars(r) for r in plugin.sensitivity.values()]
    return out


def run(smoke: bool, device: torch.device) -> dict:
    """Train the three variants with the same data and seed; returns per-mode results."""
    if smoke:
        cfg = dict(vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=1, max_position_embeddings=16)
        steps, batch = 3, 2
    else:
        cfg = dict(vocab_size=2048, hidden=256, layers=4, heads=4, kv_heads=2, max_position_embeddings=128)
        steps, batch = 150, 16
    runs = {m: _run(m, cfg, steps, batch, 1e-3, device) for m in ("fp32", "static_fp16", "adaptive_fp16")}
    return {
        "what": "constructed overflow: layer 1 mlp.down_proj weights scaled so its output peaks at 4x fp16 max",
        "model": cfg,
        "steps": steps,
        "batch": batch,
        "runs": runs,
    }
