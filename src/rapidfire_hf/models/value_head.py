"""Language models with a scalar value head, in the checkpoint format of TRL 1.12's value-head models.

``AutoModelForCausalLMWithValueHead`` and ``AutoModelForSeq2SeqLMWithValueHead`` wrap a transformers model
(``pretrained_model``) and add ``v_head`` (dropout, then ``summary``: a ``Linear(hidden, 1)``). A saved
full model is the transformers checkpoint with ``v_head.*`` tensors beside the model's own, so
``AutoModelForCausalLM.from_pretrained(dir)`` loads the policy alone and the wrapper's ``from_pretrained``
restores the head too. A PEFT model saves its adapter plus ``pytorch_model.bin`` holding only ``v_head.*``.

Passed as ``model`` to :class:`rapidfire_hf.PPOTrainer`, the causal wrapper trains as the fused policy/value
module: its ``pretrained_model`` is the policy and its ``v_head`` the value head.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

V_HEAD_PREFIX = "v_head."
_HEAD_KWARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
_PEFT_KWARGS = ("peft_config", "is_trainable")


class ValueHead(nn.Module):
    """One value per position from a hidden state: ``summary(dropout(hidden))``, squeezed to ``[..., T]``.

    Args:
        hidden_size: width of the hidden states.
        dropout: dropout probability before the projection.
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.summary.weight.dtype)
        return self.summary(self.dropout(hidden)).squeeze(-1)


def _hidden_size(config: Any) -> int:
    for name in ("hidden_size", "d_model", "n_embd", "word_embed_proj_dim"):
        size = getattr(config, name, None)
        if isinstance(size, int):
            return size
    text = getattr(config, "get_text_config", None)
    if callable(text) and text() is not config:
        return _hidden_size(text())
    raise ValueError(
        f"cannot tell the hidden size of {type(config).__name__}: it has none of hidden_size, d_model, n_embd"
    )


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _read_v_head(path: str) -> dict[str, torch.Tensor]:
    """The ``v_head.*`` tensors of a saved checkpoint folder (safetensors, sharded or not, or a .bin file
    loaded with ``weights_only=True``); an empty dict when the folder holds none."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    files: list[str] = []
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({os.path.join(path, v) for k, v in weight_map.items() if k.startswith(V_HEAD_PREFIX)})
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = [os.path.join(path, "model.safetensors")]
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.startswith(V_HEAD_PREFIX):
                    found[key] = f.get_tensor(key)
    binary = os.path.join(path, "pytorch_model.bin")
    if not found and os.path.isfile(binary):
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - re-raised with the file named
            raise ValueError(
                f"{binary} cannot be read as a tensor file ({type(err).__name__}: {err}); it may be damaged "
                "or not a state dict: re-save the model"
            ) from err
        found = {k: v for k, v in state.items() if k.startswith(V_HEAD_PREFIX)}
    return found


class PreTrainedModelWrapper(nn.Module):
    """A transformers model plus a value head; see the module docstring for the saved format.

    Attributes:
        pretrained_model: the wrapped transformers (or PEFT) model.
        v_head: the :class:`ValueHead`.
        is_peft_model: whether ``pretrained_model`` is a PEFT model.
    """

    transformers_parent_class: Any = None
    lm_head_namings = ("lm_head", "embed_out", "output_layer")

    def __init__(
        self,
        pretrained_model: nn.Module,
        summary_dropout_prob: float | None = None,
        v_head_initializer_range: float = 0.2,
        v_head_init_strategy: str | None = None,
    ):
        super().__init__()
        if v_head_init_strategy not in (None, "normal"):
            raise ValueError(f"v_head_init_strategy must be None or 'normal', got {v_head_init_strategy!r}")
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config
        if summary_dropout_prob is None:
            summary_dropout_prob = getattr(self.config, "summary_dropout_prob", None)
        dropout = 0.1 if summary_dropout_prob is None else float(summary_dropout_prob)
        self.v_head = ValueHead(_hidden_size(self.config), dropout)
        if v_head_init_strategy == "normal":
            nn.init.normal_(self.v_head.summary.weight, std=v_head_initializer_range)
            nn.init.zeros_(self.v_head.summary.bias)
        dtype = next(pretrained_model.parameters()).dtype
        device = next(pretrained_model.parameters()).device
        self.v_head.to(device=device, dtype=dtype if dtype.is_floating_point else torch.float32)
        self.is_peft_model = _is_peft(pretrained_model)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike | nn.Module, *model_args, **kwargs
    ):
        """Load (or wrap) a transformers model and add a value head.

        Args:
            pretrained_model_name_or_path: a local folder (a full checkpoint, or a PEFT adapter folder whose
                ``adapter_config.json`` names the base), a hub id, or a model object (transformers or PEFT).
            peft_config: a ``peft.PeftConfig`` to add a new adapter to a model that has none.
            is_trainable: keep a loaded PEFT adapter trainable.
            summary_dropout_prob, v_head_initializer_range, v_head_init_strategy: value-head settings.
            **kwargs: the rest goes to the transformers ``from_pretrained`` (``dtype``, ``device_map``, ...).
        """
        head_kwargs = {k: kwargs.pop(k) for k in _HEAD_KWARGS if k in kwargs}
        peft_config = kwargs.pop("peft_config", None)
        is_trainable = kwargs.pop("is_trainable", False)
        source = pretrained_model_name_or_path
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            model = cls._load_backbone(path, model_args, kwargs, is_trainable, peft_config)
            saved_head = _read_v_head(path) if os.path.isdir(path) else {}
        elif isinstance(source, nn.Module) and (isinstance(source, PreTrainedModel) or _is_peft(source)):
            model, saved_head = source, {}
            if peft_config is not None:
                model = _add_adapter(model, peft_config)
        else:
            raise TypeError(
                f"{cls.__name__}.from_pretrained takes a path, a hub id or a transformers/PEFT model, "
                f"got {type(source).__name__}"
            )
        wrapper = cls(model, **head_kwargs)
        if saved_head:
            wrapper.v_head.load_state_dict({k[len(V_HEAD_PREFIX) :]: v for k, v in saved_head.items()})
        return wrapper

    @classmethod
    def _load_backbone(cls, path, model_args, kwargs, is_trainable, peft_config) -> nn.Module:
        adapter_config = os.path.join(path, "adapter_config.json")
        if os.path.isfile(adapter_config):
            from peft import PeftConfig, PeftModel

            trained = PeftConfig.from_pretrained(path)
            base = cls.transformers_parent_class.from_pretrained(
                trained.base_model_name_or_path, *model_args, **kwargs
            )
            return PeftModel.from_pretrained(base, path, is_trainable=is_trainable)
        model = cls.transformers_parent_class.from_pretrained(path, *model_args, **kwargs)
        return _add_adapter(model, peft_config) if peft_config is not None else model

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The wrapped model's state dict (its own key names) plus ``v_head.*``."""
        state = self.pretrained_model.state_dict(*args, **kwargs)
        for key, value in self.v_head.state_dict().items():
            state[V_HEAD_PREFIX + key] = value
        return state

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Save in the format described in the module docstring (``from_pretrained`` reads it back)."""
        os.makedirs(save_directory, exist_ok=True)
        head = {V_HEAD_PREFIX + k: v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}
        if self.is_peft_model:
            self.pretrained_model.save_pretrained(save_directory, **kwargs)
            torch.save(head, os.path.join(save_directory, "pytorch_model.bin"))
            return
        state = kwargs.pop("state_dict", None) or self.pretrained_model.state_dict()
        self.pretrained_model.save_pretrained(save_directory, state_dict={**state, **head}, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        """Push the wrapped model with its value-head tensors (``transformers``' ``push_to_hub``)."""
        head = {V_HEAD_PREFIX + k: v for k, v in self.v_head.state_dict().items()}
        return self.pretrained_model.push_to_hub(
            *args, state_dict={**self.pretrained_model.state_dict(), **head}, **kwargs
        )

    def generate(self, *args, **kwargs):
        """``pretrained_model.generate``: the value head takes no part in generation."""
        return self.pretrained_model.generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, *args, **kwargs):
        return self.pretrained_model.gradient_checkpointing_enable(*args, **kwargs)

    def gradient_checkpointing_disable(self):
        return self.pretrained_model.gradient_checkpointing_disable()

    def _values(self, outputs) -> torch.Tensor:
        hidden = getattr(outputs, "decoder_hidden_states", None) or outputs.hidden_states
        return self.v_head(hidden[-1]).float()

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        return_past_key_values=False,
        **kwargs,
    ):
        """``(lm_logits, loss, values)``: the model's logits (fp32), its loss (``None`` without labels) and
        one value per position ``[B, T]``; ``past_key_values`` is appended when ``return_past_key_values``."""
        kwargs["output_hidden_states"] = True
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        outputs = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = outputs.logits.float()
        values = self._values(outputs)
        if return_past_key_values:
            return logits, outputs.loss, values, outputs.past_key_values
        return logits, outputs.loss, values


def _add_adapter(model: nn.Module, peft_config) -> nn.Module:
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}"
        )
    if _is_peft(model):
        raise ValueError("the model already has a PEFT adapter: pass peft_config=None, or the base model")
    return get_peft_model(model, peft_config)


class AutoModelForCausalLMWithValueHead(PreTrainedModelWrapper):
    """A causal LM with a value head (see :class:`PreTrainedModelWrapper`)."""

    transformers_parent_class = AutoModelForCausalLM


class AutoModelForSeq2SeqLMWithValueHead(PreTrainedModelWrapper):
    """An encoder-decoder LM with a value head on the decoder's last hidden state."""

    transformers_parent_class = AutoModelForSeq2SeqLM
