"""A sweep described in YAML (``rapidfire sweep SWEEP.yaml``): shared settings plus a ``trials:`` mapping.

.. code-block:: yaml

    model: demo                 # the embedded tiny Llama, or a local path of a HF causal LM
    dataset: demo               # the embedded prompts, or a .json/.jsonl/.csv file or a save_to_disk folder
    reward_funcs: [demo]        # "demo" (the vowel reward) or "package.module:function"
    # reward_model: path        # instead of reward_funcs: a local sequence-classification model
    lora: {r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}
    config:                     # PPOConfig fields shared by every trial
      output_dir: out/sweep
      max_steps: 40
    trials:
      kl0.01: {kl_coef: 0.01}
      kl0.2: {kl_coef: 0.2, learning_rate: 2.0e-5}
    early_stopping: {metric: objective/scores, after_updates: 10, margin: 0.1}

Every key is checked before anything loads: an unknown key, an unknown PPOConfig field in ``config`` or a
trial, or a field trials must share raises a ``ConfigError`` naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from rapidfire_hf.config import ConfigError

KEYS = ("model", "dataset", "reward_funcs", "reward_model", "lora", "config", "trials", "early_stopping")
DEFAULT_LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


# where the keys of a long list are written down (the error names the closest key and points here)
CONFIG_KEYS = (
    "a field of rapidfire_hf.PPOConfig "
    "(python -c 'import rapidfire_hf; help(rapidfire_hf.PPOConfig)' lists them)"
)
TRIAL_KEYS = "a field of rapidfire_hf.sweep.PER_TRIAL_FIELDS (docs/sweep.md, 'What a trial owns', lists them)"


def _unknown(key: str, known, where: str, listed: str | None = None) -> ConfigError:
    """``where.key: unknown key (did you mean closest?)`` plus the valid keys, or where they are listed."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    allowed = listed or ", ".join(sorted(known))
    return ConfigError(f"unknown key{hint}", key=f"{where}{key}", allowed=allowed)


def validate(data: dict, source: str | None = None) -> dict:
    """Check a sweep document; returns it with defaults filled in. Raises ConfigError naming the key."""
    from rapidfire_hf.ppo import PPOConfig
    from rapidfire_hf.sweep.control import EarlyStopping
    from rapidfire_hf.sweep.trial import PER_TRIAL_FIELDS

    try:
        for key in data:
            if key not in KEYS:
                raise _unknown(key, KEYS, "")
        trials = data.get("trials")
        if not isinstance(trials, dict) or not trials:
            raise ConfigError("needs a mapping of trial name -> overrides", key="trials", value=trials)
        ppo_fields = {f.name for f in dataclasses.fields(PPOConfig) if f.init}
        config = data.get("config") or {}
        for key in config:
            if key not in ppo_fields:
                raise _unknown(key, ppo_fields, "config.", CONFIG_KEYS)
        for name, overrides in trials.items():
            if not isinstance(overrides, dict | None):
                raise ConfigError(
                    "must be a mapping of PPOConfig fields", key=f"trials.{name}", value=overrides
                )
            for key in overrides or {}:
                if key not in ppo_fields:
                    raise _unknown(key, PER_TRIAL_FIELDS, f"trials.{name}.", TRIAL_KEYS)
                if key not in PER_TRIAL_FIELDS:
                    raise ConfigError(
                        "is shared by every trial (one batched decode): set it under config",
                        key=f"trials.{name}.{key}",
                        allowed=TRIAL_KEYS,
                    )
        if ("reward_funcs" in data) == ("reward_model" in data):
            raise ConfigError("give exactly one of reward_funcs and reward_model", key="reward_funcs")
        es_fields = {f.name for f in dataclasses.fields(EarlyStopping)}
        for key in data.get("early_stopping") or {}:
            if key not in es_fields:
                raise _unknown(key, es_fields, "early_stopping.")
    except ConfigError as err:
        raise (err.with_source(source) if source else err) from None
    return {"model": "demo", "dataset": "demo", "lora": DEFAULT_LORA, **data}


def load_spec(path: str | Path) -> dict:
    """Read and validate a sweep YAML file."""
    from rapidfire_hf.config.loader import read_yaml

    if not Path(path).is_file():  # before read_yaml, whose message also offers a config preset name
        raise ConfigError(
            "sweep file not found", value=str(path), allowed="the path of a sweep YAML file (docs/sweep.md)"
        )
    return validate(dict(read_yaml(path)), source=str(path))


def _reward_func(name: str):
    if name == "demo":
        from rapidfire_hf.demo import vowel_reward

        return vowel_reward
    module, _, attr = str(name).partition(":")
    allowed = "'demo' or 'package.module:function', importable from the current folder or PYTHONPATH"
    if not module or not attr:
        raise ConfigError("must be 'demo' or 'package.module:function'", key="reward_funcs", value=name)
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` does: ./mymod.py imports
        sys.path.insert(0, os.getcwd())
    try:
        func = getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise ConfigError(f"cannot import module {module!r} ({err})", key="reward_funcs", value=name,
                          allowed=allowed) from None  # fmt: skip
    except AttributeError:
        raise ConfigError(f"module {module!r} has no {attr!r}", key="reward_funcs", value=name,
                          allowed=allowed) from None  # fmt: skip
    if not callable(func):
        raise ConfigError(f"{module}.{attr} is not a function", key="reward_funcs", value=name)
    return func


def _dataset(src: str, seed: int):
    from rapidfire_hf.demo import make_prompt_dataset

    if src == "demo":
        return make_prompt_dataset(512, seed=seed)
    path = Path(src)
    if not path.exists():
        raise ConfigError("no such local file or folder", key="dataset", value=src)
    import datasets

    if path.is_dir():
        return datasets.load_from_disk(str(path))
    kind = {".json": "json", ".jsonl": "json", ".csv": "csv"}.get(path.suffix)
    if kind is None:
        raise ConfigError(
            "unknown dataset file type", key="dataset", value=src, allowed=".json, .jsonl, .csv"
        )
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def build(spec: dict, progress: bool = True, callbacks=None):
    """A :class:`PPOSweep` from a validated spec (models loaded from local paths only)."""
    from peft import LoraConfig

    from rapidfire_hf.ppo import PPOConfig
    from rapidfire_hf.sweep import EarlyStopping, PPOSweep

    funcs = None
    if "reward_model" not in spec:  # a reward function that does not import fails before any model loads
        names = spec["reward_funcs"] if isinstance(spec["reward_funcs"], list) else [spec["reward_funcs"]]
        funcs = [_reward_func(n) for n in names]
    config: dict[str, Any] = {"report_to": [], **(spec.get("config") or {})}
    config.setdefault("output_dir", "rapidfire_sweep")
    args = PPOConfig(**config)
    if spec["model"] == "demo":
        from rapidfire_hf.demo import DemoTask

        tok, model, _, _ = DemoTask(seed=args.seed).build()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(spec["model"]).exists():
            raise ConfigError(
                "no such local path (sweeps never download models)", key="model", value=spec["model"]
            )
        tok = AutoTokenizer.from_pretrained(spec["model"])
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(spec["model"])
    reward_model = None
    if "reward_model" in spec:
        from transformers import AutoModelForSequenceClassification

        reward_model = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"])
    es = spec.get("early_stopping")
    return PPOSweep(
        args=args,
        trials={n: dict(o or {}) for n, o in spec["trials"].items()},
        model=model,
        processing_class=tok,
        train_dataset=_dataset(spec["dataset"], args.seed),
        peft_config=LoraConfig(**spec["lora"]),
        reward_funcs=funcs,
        reward_model=reward_model,
        callbacks=callbacks,
        early_stopping=EarlyStopping(**es) if es else None,
        progress=progress,
    )
