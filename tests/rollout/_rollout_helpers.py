"""Reference computations for the rollout tests: a fresh forward pass and plain ``model.generate``."""

from __future__ import annotations

import contextlib

import torch


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
