"""Reference computations for the rollout tests: a fresh forward pass and plain ``model.generate``."""

from __future__ import annotations

import contextlib

import torch

from rapidfire_hf.rollout.families import FAMILIES
from rapidfire_hf.rollout.moe_decode import is_moe_block, router_of

# bf16 keeps 8 significant bits (2**-8 relative); the engine's kernels and HF's round differently through
# every layer, so a choice within a few roundings of the top logit is a tie, not an error
BF16_TIE = 2**-5


def fresh_logits(model, sequences: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of a plain forward over prompt + response, positions counted from the first real token."""
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_mask.shape[1] :])], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits.float()


@contextlib.contextmanager
def no_default_eos(model):
    gen_config = (model.get_base_model() if hasattr(model, "get_base_model") else model).generation_config
    saved, gen_config.eos_token_id = gen_config.eos_token_id, None
    try:
        yield
    finally:
        gen_config.eos_token_id = saved


def hf_greedy(model, input_ids, attention_mask, max_new_tokens: int, stop: int | None, pad: int = 0):
    """``model.generate`` greedy responses ``[B, max_new_tokens]`` (right-padded with pad when it stops early).

    ``stop=None`` means no stop token at all: generate would otherwise fall back to the model's
    ``generation_config.eos_token_id``, so that is hidden for the call.
    """
    with no_default_eos(model), torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=pad,
        )
    resp = out[:, input_ids.shape[1] :]
    return torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=pad)


def _router_logits(model, sequences, prompt_mask):
    """Per routed MoE layer: its router logits ``[B, T, E]`` and top-k in the fresh forward (:func:`fresh_logits`)."""
    body = getattr(model, "model", model)
    fam = FAMILIES.get(model.config.model_type)
    mlps = [getattr(layer, fam.mlp if fam else "mlp", None) for layer in getattr(body, "layers", [])]
    gates = [router_of(m) for m in mlps if m is not None and is_moe_block(m)]
    seen = []

    def keep(module, args, out):
        # the router's logits over all E experts: first of the tuple in transformers 5.25, last in 5.17's
        # Granite-MoE router ((top_k_index, top_k_weights, router_logits)); found by their width
        e = module.weight.shape[0]
        outs = out if isinstance(out, tuple) else (out,)
        logits = next(t for t in outs if t.is_floating_point() and t.shape[-1] == e)
        seen.append((logits.float(), module))

    handles = [g.register_forward_hook(keep) for g in gates]
    try:
        logits = fresh_logits(model, sequences, prompt_mask)
    finally:
        for h in handles:
            h.remove()
    b, t = sequences.shape
    k = getattr(model.config, "num_experts_per_tok", 1)
    return logits, [r.reshape(b, t, -1) for r, _ in seen], k


def argmax_misses(model, out, prompt_mask, tie: float = BF16_TIE) -> tuple[list[str], float]:
    """Where the greedy tokens of ``out`` (a ``RolloutOutput``) are not the argmax of the model's own forward
    over ``out.sequences``: a token is a tie, not a miss, when its logit is within ``tie`` of the top one
    (relative, the top's magnitude at least 1); and in a routed MoE model when some layer's router at that
    position was within ``tie`` of swapping its k-th and (k+1)-th expert (the same relative bound on the
    router logits): then rounding picks the experts, and the position's whole hidden state moves with them.

    Returns:
        one line per miss (row, step, the top-2 logit gap, the smallest router gap there) and the fraction
        of tokens that are the exact argmax.
    """
    logits, routers, k = _router_logits(model, out.sequences, prompt_mask)
    p = out.prompt_length
    logits = logits[:, p - 1 : -1]
    chosen = logits.gather(-1, out.responses[..., None]).squeeze(-1)
    top = logits.max(-1).values
    bound = tie * top.abs().clamp_min(1.0)
    router_gap = torch.full_like(top, float("inf"))  # per position: the smallest relative k / k+1 gap
    for r in routers:
        v = r[:, p - 1 : -1].topk(k + 1, dim=-1).values
        router_gap = torch.minimum(
            router_gap, (v[..., k - 1] - v[..., k]) / v[..., k - 1].abs().clamp_min(1.0)
        )
    misses = []
    for row, step in ((top - chosen) > bound).nonzero().tolist():
        gap = router_gap[row, step].item()
        if gap <= tie:
            continue
        misses.append(
            f"row {row} step {step}: chose {out.responses[row, step].item()} at {chosen[row, step].item():.4f}, "
            f"top {top[row, step].item():.4f} (bound {bound[row, step].item():.4f}); smallest router gap {gap:.3g}"
        )
    return misses, (chosen == top).float().mean().item()
