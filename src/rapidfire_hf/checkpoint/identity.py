"""What makes a resumed run the same run: the identity written into a checkpoint's manifest, and the check.

A checkpoint of a LoRA run holds the adapter only; a checkpoint of a full run holds the policy but not the
frozen reference. Loading either on top of another base model, another tokenizer or another adapter
config continues a different run without an error: the shapes all fit. So a checkpoint records

- ``frozen_models``: a fingerprint of every frozen network the run scores with (the LoRA base, the
  reference model, the reward model): for each parameter its dtype, shape and a hash of 16 of its values
  at fixed positions (one gather and one copy to the host for the whole model), so another model of the
  same architecture and shape (another seed, another revision) is caught, naming the first parameter that
  differs;
- ``tokenizer``: its size and a SHA-256 of its vocabulary (token -> id), added tokens and special ids;
- ``adapters``: the LoRA settings that change the computation (``r``, ``lora_alpha``, targets, ...);
- ``value_head``: how values are computed (fused head or a separate model) and its parameter shapes.

:func:`compare_identity` names each difference. The PPOConfig settings an entry point must keep on resume are
compared by :func:`rapidfire_hf.ppo.field_facts.compare_settings` (each field declares what another value changes).
"""

from __future__ import annotations

import hashlib
import json
import math

import torch

_SAMPLES = 16  # values hashed per parameter: first, last and evenly spaced between

# LoraConfig fields that change what an adapter computes or how it trains; other fields (paths, revision,
# inference_mode, the peft version) do not
ADAPTER_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "use_dora",
    "lora_dropout",
    "bias",
    "modules_to_save",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "layers_pattern",
    "exclude_modules",
)


def plain_value(value):
    """A JSON value for ``value``: sets and tuples as sorted lists, enums by value, the rest as text."""
    if isinstance(value, (set, frozenset)):
        return sorted(plain_value(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))


def _base_name(name: str) -> str:
    """A parameter's name without PEFT's wrapping, so the base reads the same with and without it."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def model_fingerprint(model: torch.nn.Module | None) -> dict[str, str] | None:
    """``{parameter: "dtype[shape]:hash"}`` over the frozen parameters of ``model`` (LoRA weights left out).

    The hash covers ``_SAMPLES`` values at fixed positions of each parameter, read in one gather per
    parameter and one host copy for the model. Sharded parameters (DTensor, DeepSpeed ZeRO-3) and those on
    the meta device are fingerprinted by name, dtype and shape only: their values differ per process.
    """
    if model is None:
        return None
    model = getattr(model, "module", model)  # DDP
    entries, samples = [], []
    for name, p in model.named_parameters():
        if p.requires_grad or "lora_" in name or "modules_to_save" in name:
            continue
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        head = f"{str(p.dtype).removeprefix('torch.')}{list(shape)}"
        local = p.detach()
        if hasattr(local, "to_local") or hasattr(p, "ds_numel") or local.is_meta or local.numel() == 0:
            entries.append((_base_name(name), head, None))
            continue
        flat = local.reshape(-1)
        k = min(_SAMPLES, flat.numel())
        # integer positions (a float linspace rounds past the end beyond 2**24 elements)
        index = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)
        entries.append((_base_name(name), head, len(samples)))
        samples.append(flat[index].contiguous().view(torch.uint8).reshape(-1))  # the values' exact bytes
    if not entries:
        return None
    if len({s.device for s in samples}) == 1:  # one copy to the host for the whole model
        host = list(torch.split(torch.cat(samples).cpu(), [s.numel() for s in samples]))
    else:  # a model spread over devices (device_map)
        host = [s.cpu() for s in samples]
    out = {}
    for name, head, k in entries:
        digest = "-" if k is None else hashlib.sha256(host[k].numpy().tobytes()).hexdigest()[:16]
        out[name] = f"{head}:{digest}"
    return out


def tokenizer_identity(tok) -> dict | None:
    """Size and SHA-256 of a tokenizer's vocabulary, added tokens and special token ids."""
    if tok is None or not hasattr(tok, "get_vocab"):
        return None
    vocab = sorted((str(k), int(v)) for k, v in tok.get_vocab().items())
    special = {
        k: getattr(tok, k, None) for k in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id")
    }
    data = json.dumps({"vocab": vocab, "special": special}, sort_keys=True).encode()
    return {"size": len(vocab), "sha256": hashlib.sha256(data).hexdigest(), "special_ids": special}


def adapter_identity(peft_config) -> dict | None:
    """The fields of a ``LoraConfig`` (or of each adapter of a ``{name: config}`` mapping) that change what
    the adapter computes; None without one."""
    if peft_config is None:
        return None
    if isinstance(peft_config, dict):
        return {str(name): adapter_identity(cfg) for name, cfg in sorted(peft_config.items())}
    return {
        "type": type(peft_config).__name__,
        **{k: plain_value(getattr(peft_config, k)) for k in ADAPTER_FIELDS if hasattr(peft_config, k)},
    }


def value_head_identity(mode: str, state: dict[str, torch.Tensor] | None) -> dict:
    """How values are computed (``fused`` head or ``separate`` model) and the value parameters' shapes."""
    shapes = {k: list(v.shape) for k, v in (state or {}).items()}
    return {"mode": mode, "shapes": shapes}


# ------------------------------------------------------------------------------------------- comparing
def _first_model_difference(saved: dict, now: dict) -> str:
    only_saved = [k for k in saved if k not in now]
    only_now = [k for k in now if k not in saved]
    if only_saved or only_now:
        return (
            f"other parameters (only in the checkpoint's: {only_saved[:3]}, only in this run's: {only_now[:3]}): "
            "another architecture"
        )
    for name in now:
        a_head, _, a_hash = saved[name].rpartition(":")
        b_head, _, b_hash = now[name].rpartition(":")
        if a_head != b_head:
            return f"parameter {name} is {a_head} in the checkpoint's and {b_head} in this run's"
        if a_hash != b_hash:
            return (
                f"parameter {name} holds other values (same dtype and shape): another model of the same shape, "
                "another revision or another seed"
            )
    return "they differ"


def compare_identity(saved: dict, now: dict) -> list[str]:
    """One line per difference between a checkpoint's identity and this run's (empty: the same run)."""
    problems = []
    a, b = _flatten(saved.get("adapters")), _flatten(now.get("adapters"))
    for key in dict.fromkeys([*a, *b]):
        if a.get(key, "(none)") != b.get(key, "(none)"):
            problems.append(
                f"LoRA adapter {key}: saved {a.get(key, '(none)')!r}, this run {b.get(key, '(none)')!r} (peft_config)"
            )
    if saved.get("value_head") != now.get("value_head"):
        problems.append(
            f"value head: the checkpoint's is {saved.get('value_head')}, this run's is {now.get('value_head')}"
        )
    a, b = saved.get("tokenizer"), now.get("tokenizer")
    if a != b:
        if isinstance(a, dict) and isinstance(b, dict) and a.get("size") == b.get("size"):
            what = (
                "the same size but other token ids"
                if a.get("sha256") != b.get("sha256")
                else "other special ids"
            )
            problems.append(
                f"tokenizer (processing_class): {what} (checkpoint {a.get('special_ids')}, this run "
                f"{b.get('special_ids')}): every prompt and response would be other tokens"
            )
        else:
            size_a = a.get("size") if isinstance(a, dict) else None
            size_b = b.get("size") if isinstance(b, dict) else None
            problems.append(
                f"tokenizer (processing_class): {size_a} tokens in the checkpoint, {size_b} in this run"
            )
    saved_models, now_models = saved.get("frozen_models") or {}, now.get("frozen_models") or {}
    for role in sorted(set(saved_models) | set(now_models)):
        a, b = saved_models.get(role), now_models.get(role)
        if a == b:
            continue
        if a is None or b is None:
            problems.append(f"{role}: {'none' if a is None else 'one'} in the checkpoint's run, "
                            f"{'none' if b is None else 'one'} in this run")  # fmt: skip
        else:
            problems.append(f"{role}: {_first_model_difference(a, b)}")
    return problems


def _flatten(value, prefix: str = "") -> dict:
    """``{"policy.lora_alpha": 8, ...}`` from nested mappings (a leaf: anything else, or an empty mapping)."""
    if not isinstance(value, dict) or not value:
        return {prefix or "config": value} if value is not None else {}
    out = {}
    for k, v in value.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
