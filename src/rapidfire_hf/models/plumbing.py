"""Where the pieces of a Hugging Face causal LM are: the model under a PEFT wrapper, its decoder layers, its
final norm, its ``(decoder, lm_head)`` pair, a sequence classifier's ``(backbone, score)`` pair, and which
layers attend through a sliding window (the rollout engine's ring caches and the memory planner's KV bytes
both read it). Every part asks here instead of walking the attributes itself.
"""

from __future__ import annotations

from torch import nn


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in its modules); any other
    model is returned as it is."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _backbone(base: nn.Module) -> nn.Module:
    """The decoder stack of an unwrapped model (``model.model`` for Llama: its ``base_model_prefix``), or
    the model itself when it has none."""
    return getattr(base, getattr(base, "base_model_prefix", ""), None) or base


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks of a transformers model (causal LM or sequence classifier, PEFT-wrapped
    or not): the ``layers`` ModuleList of its backbone (``model.model.layers`` for Llama).

    Raises:
        TypeError: no ``layers`` ModuleList under the model's backbone.
    """
    base = unwrap_peft(model)
    layers = getattr(_backbone(base), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        prefix = getattr(base, "base_model_prefix", "")
        where = f".{prefix}.layers" if prefix else ".layers"
        raise TypeError(f"{type(base).__name__}: no decoder layers found at {where} (no `layers` ModuleList)")
    return layers


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last decoder layer (``model.model.norm`` for Llama), or None when there is none."""
    norm = getattr(_backbone(unwrap_peft(model)), "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(decoder, lm_head)`` of a transformers causal LM (PEFT-wrapped or not).

    Raises:
        TypeError: the model has no decoder/output-embedding pair (not a causal LM).
    """
    base = unwrap_peft(model)
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is base:
        raise TypeError(
            f"{type(base).__name__} is not a supported causal LM: PPOTrainer needs a transformers model with "
            "get_decoder() and get_output_embeddings() (an AutoModelForCausalLM)."
        )
    return decoder, head


def classifier_parts(model: nn.Module, role: str = "model") -> tuple[nn.Module, nn.Module]:
    """``(backbone, score)`` of a transformers sequence-classification model (a value or reward model):
    the module at its ``base_model_prefix`` (``model.model`` for Llama), which gives per-position hidden
    states, and the ``score`` head that maps them to outputs.

    Args:
        model: e.g. an ``AutoModelForSequenceClassification`` with one label.
        role: how the error names the model (``"value_model"``, ``"reward_model"``).

    Raises:
        TypeError: no backbone at ``base_model_prefix`` or no ``score`` module.
    """
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if prefix else None
    score = getattr(model, "score", None)
    if not isinstance(backbone, nn.Module) or not isinstance(score, nn.Module):
        raise TypeError(
            f"{role} ({type(model).__name__}) must be a transformers sequence-classification model (a backbone "
            "at its base_model_prefix and a `score` head), e.g. AutoModelForSequenceClassification.from_pretrained"
            "(path, num_labels=1)"
        )
    return backbone, score


def disable_dropout(module: nn.Module) -> None:
    """Dropout off in every submodule: PPO's forwards must be functions of their rows and weights alone
    (the rollout's log-probs and the training forward's must agree; a sweep trial must not depend on its
    neighbours' rows)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def layer_windows(config) -> list[int | None]:
    """Per layer: the sliding window (keys with ``slot > query_slot - window`` are seen) or None for full
    attention, as the model's own mask builder decides it: per ``layer_types`` where the config has them,
    else ``sliding_window`` for every layer (Mistral, Phi-3, Mixtral, Qwen3-MoE). ``config``: a HF config."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[:n]]
    return [window] * n
