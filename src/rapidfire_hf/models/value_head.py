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

    The one value head of the package: PPOTrainer's fused value head, each PPOSweep trial's, and the
    ``v_head`` of the value-head models below (TRL's checkpoint layout: ``summary.weight``, ``summary.bias``).

    Args:
        hidden_size: width of the hidden states.
        dropout: dropout probability before the projection (PPOTrainer turns dropout off).
        init: ``"scaled"`` (PPO's fused head: weight ~ N(0, 1/(hidden_size+1)), bias 0, drawn after
            ``nn.Linear``'s own init, so the global RNG advances as it always did) or ``"linear"``
            (``nn.Linear``'s default init, as TRL's value-head models).

    Example:
        >>> head = ValueHead(64)
        >>> head(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5])
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0, init: str = "scaled"):
        super().__init__()
        if init not in ("scaled", "linear"):
            raise ValueError(f"ValueHead init must be 'scaled' or 'linear', got {init!r}")
        self.dropout = nn.Dropout(dropout)
        self.summary = nn.Linear(hidden_size, 1)
        if init == "scaled":
            nn.init.normal_(self.summary.weight, std=1.0 / (hidden_size + 1) ** 0.5)
            nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., T, H]`` hidden states -> ``[..., T]`` values (in the head's dtype)."""
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


class ValueHeadLoadError(ValueError):
    """Saved ``v_head.*`` tensors that ``from_pretrained`` refuses to load; the message names the folder or
    file, the tensor, what was expected and the fix. Raised before the value head is changed."""


_SAFETENSORS = "model.safetensors"
_BINARY = "pytorch_model.bin"
_HEAD_KEYS = (V_HEAD_PREFIX + "summary.weight", V_HEAD_PREFIX + "summary.bias")  # ValueHead's state dict


def _index_files(path: str, index: str) -> dict[str, str]:
    """``{v_head key: shard path}`` of the sharded index ``index`` in ``path``; refuses shards outside ``path``
    (absolute paths, ``..``) and shards that are not there."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise ValueError(f"weight_map is a {type(weight_map).__name__}, not a mapping")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueHeadLoadError(
            f"{index} cannot be read as a sharded-checkpoint index ({type(err).__name__}: {err}): re-save the model"
        ) from err
    files: dict[str, str] = {}
    for key, name in weight_map.items():
        if not key.startswith(V_HEAD_PREFIX):
            continue
        relative = os.path.normpath(name) if isinstance(name, str) else ""
        if (
            not relative
            or os.path.isabs(name)
            or relative == os.pardir
            or relative.startswith(os.pardir + os.sep)
        ):
            raise ValueHeadLoadError(
                f"{index} maps {key} to {name!r}, which is not a file inside {path}: a checkpoint index may only "
                "name shards in its own folder; fix the index's weight_map or re-save the model"
            )
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            raise ValueHeadLoadError(
                f"{index} maps {key} to {name!r}, but {file} does not exist: copy the missing shard in or "
                "re-save the model"
            )
        files[key] = file
    return files


def _load_binary(file: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        raise ValueHeadLoadError(
            f"{file} cannot be read as a tensor file ({type(err).__name__}: {err}); it may be damaged "
            "or not a state dict: re-save the model"
        ) from err
    if not isinstance(state, dict):
        raise ValueHeadLoadError(
            f"{file} holds a {type(state).__name__}, not a state dict of named tensors: re-save the model"
        )
    return state


def _read_file(file: str, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The ``v_head.*`` tensors of one safetensors or .bin file (only ``keys``, each required, when given)."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
                wanted = keys if keys is not None else [k for k in names if k.startswith(V_HEAD_PREFIX)]
                missing = [k for k in wanted if k not in names]
                state = {k: f.get_tensor(k) for k in wanted if k in names}
        except Exception as err:  # noqa: BLE001 - re-raised with the file named
            raise ValueHeadLoadError(
                f"{file} cannot be read as a safetensors file ({type(err).__name__}: {err}); it may be "
                "damaged: re-save the model"
            ) from err
    else:
        whole = _load_binary(file)
        wanted = keys if keys is not None else [k for k in whole if str(k).startswith(V_HEAD_PREFIX)]
        missing = [k for k in wanted if k not in whole]
        state = {k: whole[k] for k in wanted if k in whole}
    if missing:
        raise ValueHeadLoadError(
            f"the checkpoint index maps {', '.join(missing)} to {file}, which does not hold it: re-save the model"
        )
    return state


def _read_v_head(path: str) -> dict[str, tuple[torch.Tensor, str]]:
    """The ``v_head.*`` tensors of a saved checkpoint folder, each with the file it came from: from the first
    of ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json`` and
    ``pytorch_model.bin`` (loaded with ``weights_only=True``) that holds any; an empty dict when none does.
    Refuses index entries outside the folder and tensors that are not finite floating-point numbers."""
    found: dict[str, tuple[torch.Tensor, str]] = {}
    for name in (_SAFETENSORS + ".index.json", _SAFETENSORS, _BINARY + ".index.json", _BINARY):
        source = os.path.join(path, name)
        if not os.path.isfile(source):
            continue
        if name.endswith(".index.json"):
            by_file: dict[str, list[str]] = {}
            for key, file in _index_files(path, source).items():
                by_file.setdefault(file, []).append(key)
            for file, keys in sorted(by_file.items()):
                found.update({k: (v, file) for k, v in _read_file(file, keys).items()})
        else:
            found = {k: (v, source) for k, v in _read_file(source).items()}
        if found:
            break
    for key, (tensor, file) in found.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueHeadLoadError(
                f"{file}: {key} is {kind}, not a floating-point tensor: re-save the model's value head"
            )
        bad = ~torch.isfinite(tensor)
        if bad.any():
            nan = int(torch.isnan(tensor).sum())
            raise ValueHeadLoadError(
                f"{file}: {key} holds {nan} NaN and {int(bad.sum()) - nan} infinite value(s) of {tensor.numel()}; "
                "the value head diverged or the file is damaged: load an earlier checkpoint, or load the "
                "policy alone (AutoModelForCausalLM.from_pretrained) and pass it to from_pretrained for a new head"
            )
    return found


def _files_of(found: dict[str, tuple[torch.Tensor, str]]) -> str:
    return ", ".join(sorted({file for _, file in found.values()}))


def _check_head_keys(path: str, found: dict[str, tuple[torch.Tensor, str]]) -> None:
    """Refuse a PEFT folder without a saved head, a partial head and unexpected ``v_head.*`` tensors."""
    if not found and os.path.isfile(os.path.join(path, "adapter_config.json")):
        where = ", ".join(n for n in (_BINARY, _SAFETENSORS) if os.path.isfile(os.path.join(path, n)))
        raise ValueHeadLoadError(
            f"{path} is a PEFT adapter folder without a value head: expected {' and '.join(_HEAD_KEYS)} in "
            f"{os.path.join(path, _BINARY)} (what save_pretrained writes beside a PEFT adapter; "
            f"{_SAFETENSORS} or a sharded index also work), "
            + (f"but {where} holds no v_head.* tensor" if where else "but no such file is there")
            + ". Fix: copy the head file saved with this adapter into the folder; or, to start a new random "
            "value head (an adapter trained without one, e.g. by SFT), load the adapter with "
            "peft.PeftModel.from_pretrained(base_model, folder) and pass that model to from_pretrained"
        )
    if not found:
        return
    unexpected = sorted(set(found) - set(_HEAD_KEYS))
    if unexpected:
        raise ValueHeadLoadError(
            f"{_files_of({k: found[k] for k in unexpected})}: unexpected value-head tensor(s) "
            f"{', '.join(unexpected)}; a value head has exactly {', '.join(_HEAD_KEYS)}: the checkpoint was "
            "saved by another value-head class or edited; remove those tensors or re-save the model"
        )
    missing = [k for k in _HEAD_KEYS if k not in found]
    if missing:
        raise ValueHeadLoadError(
            f"{_files_of(found)}: partial value head: {', '.join(sorted(found))} present but "
            f"{', '.join(missing)} missing; a value head needs {', '.join(_HEAD_KEYS)}: re-save the model"
        )


def _check_head_shapes(head: nn.Module, found: dict[str, tuple[torch.Tensor, str]]) -> None:
    for key, target in head.state_dict().items():
        tensor, file = found[V_HEAD_PREFIX + key]
        if tensor.shape != target.shape:
            raise ValueHeadLoadError(
                f"{file}: {V_HEAD_PREFIX + key} has shape {tuple(tensor.shape)}, but this model's value head "
                f"expects {tuple(target.shape)} (hidden size {head.summary.in_features}): the head was saved "
                "with another model; load it with the base model it was trained on, or re-save the model"
            )


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
        self.v_head = ValueHead(_hidden_size(self.config), dropout, init="linear")
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

        Raises:
            ValueHeadLoadError: a local folder's saved value head cannot be loaded as it is: a PEFT adapter
                folder without its head file (``pytorch_model.bin``), NaN/inf or non-float head tensors, a
                sharded index naming a ``v_head.*`` shard outside the folder (or one that is missing), a
                partial head, unexpected ``v_head.*`` tensors, or a shape that does not match the model. A
                full checkpoint without any ``v_head.*`` tensor is a plain model: it gets a new head.
        """
        head_kwargs = {k: kwargs.pop(k) for k in _HEAD_KWARGS if k in kwargs}
        peft_config = kwargs.pop("peft_config", None)
        is_trainable = kwargs.pop("is_trainable", False)
        source = pretrained_model_name_or_path
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            saved_head = _read_v_head(path) if os.path.isdir(path) else {}
            if os.path.isdir(path):
                _check_head_keys(path, saved_head)  # before the (maybe large) backbone loads
            model = cls._load_backbone(path, model_args, kwargs, is_trainable, peft_config)
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
            _check_head_shapes(wrapper.v_head, saved_head)
            wrapper.v_head.load_state_dict({k[len(V_HEAD_PREFIX) :]: v for k, (v, _) in saved_head.items()})
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
